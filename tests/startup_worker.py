"""One rank of tests/test_startup.py: ``python -m tests.startup_worker SCENARIO OUT``.

The parent sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (and runs the
ranks in two network namespaces for a shaped link). The same model is trained from the
same weights and batches with DDP, with ScheduledOptimizer and with DDP + the scheduled
hook, the mode switch at its defaults (the start-up prediction on); each run's parameters,
losses, modes and prediction are saved to ``OUT/SCENARIO.rank<N>.pt``.

Scenarios: ``fast`` (an MLP with a large batch on loopback: its communication hides in
DDP's backward) and
``slow`` (a link shaped by the parent; a model whose forward starts with compute that sends
nothing and ends with a large layer, whose gradient comes first in backward: the schedule
sends it during the next forward, DDP after the backward).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

import bytescheduler.pytorch as bsp

STEPS = 12


class FrontHeavy(nn.Module):
    """Compute that sends nothing first (a fixed matrix, no gradient), a large layer last."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("fixed", torch.randn(512, 512) / 22.6)
        self.small = nn.Linear(512, 512)
        self.large = nn.Linear(512, 4096)  # 8 MiB of gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for _ in range(40):
                x = torch.tanh(x @ self.fixed)
        return self.large(torch.relu(self.small(x)))


def mlp() -> nn.Module:
    """Its first layer, whose gradient comes last in backward, is small (nothing to wait for)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16))


# model, input width, batch (the MLP's large batch: compute well above the last bucket's all-reduce)
MODELS = {"fast": (mlp, 32, 2048), "slow": (FrontHeavy, 512, 64)}


def train(scenario: str, system: str) -> Dict[str, Any]:
    build, width, batch = MODELS[scenario]
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = None
    net: nn.Module = model
    if system == "optimizer":
        optimizer = bsp.ScheduledOptimizer(model, optimizer)
    else:
        net = nn.parallel.DistributedDataParallel(model)
        if system == "hook":
            state = bsp.ScheduledHookState(model=model)
            net.register_comm_hook(state, bsp.scheduled_allreduce_hook)
    losses: List[torch.Tensor] = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        x = torch.randn(batch, width, generator=generator)
        optimizer.zero_grad()
        loss = net(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    result: Dict[str, Any] = {"losses": losses}
    if system == "optimizer":
        engine = optimizer._bytescheduler
        chooser, startup = engine.chooser, engine._switch.startup
        optimizer.close()
    elif system == "hook":
        chooser, startup = state.driver.chooser, state.driver.startup
        state.close()
    else:
        chooser = startup = None
    if chooser is not None:
        prediction = startup.prediction
        result.update(modes="".join(mode[0] for mode in chooser.history), probed=startup.link is not None,
                      prediction=None if prediction is None else prediction.mode,
                      predicted=prediction is not None, report=None if prediction is None else prediction.text())
    result["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


def main(scenario: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {system: train(scenario, system) for system in ("ddp", "optimizer", "hook")}
    torch.save(results, os.path.join(out, f"{scenario}.rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
