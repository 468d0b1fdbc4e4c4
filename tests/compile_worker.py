"""One rank of a torch.compile scenario (tests/test_compile.py): ``python -m tests.compile_worker SCENARIO OUT``.

Each system of the scenario is built fresh from the same weights
(``bytescheduler_tools.bench.compile_check.build_system``) and trained on this rank's own
batches; the rank saves, per system, the final parameters, every loss, the dynamo
compilations and graph breaks of each step, and (ScheduledOptimizer) the mode of each step.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bytescheduler_tools.bench.compile_check import CompileCounter, build_system, compile_parts

STEPS = 16


class SlowSGD(torch.optim.SGD):
    """SGD whose every step takes 20 ms longer: ScheduledOptimizer's updates land well into
    the next forward, so a read that does not wait for them reads the weights of the step
    before (and the numbers differ)."""

    def step(self, closure=None):
        time.sleep(0.02)
        return super().step(closure)


# Trials from the fourth step, two steps each: both paths run (and compile) within STEPS.
QUICK_SWITCH = {"warmup": 3, "trial": 2, "trial_seconds": 0.01, "predict": False}

# scenario -> (model, [(system, scheduler options, step at which its children are compiled)])
SCENARIOS = {
    "tiny": ("tiny", [("allreduce-compiled", {}, None), ("scheduled-compiled", {"mode_switch": QUICK_SWITCH}, None),
                      ("ddp-compiled", {}, None), ("hook-compiled", {}, None)]),
    "parts": ("gpt2-small", [("allreduce", {"optimizer_class": SlowSGD}, 3),
                             ("scheduled", {"adaptive": False, "optimizer_class": SlowSGD}, 3)]),
    "slow": ("gpt2-small", [("allreduce-compiled", {"optimizer_class": SlowSGD}, None),
                            ("scheduled-compiled", {"adaptive": False, "optimizer_class": SlowSGD}, None)]),
}


def main() -> None:
    scenario, out = sys.argv[1], pathlib.Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    counter = CompileCounter()
    model_name, systems = SCENARIOS[scenario]
    results = {}
    try:
        for name, options, parts_at in systems:
            key = name if parts_at is None else f"{name}-parts-at-{parts_at}"
            system = build_system(name, model_name, rank, 2, batch_size=8, **options)
            compiles, breaks = [], []
            for step in range(STEPS):
                if step == parts_at:
                    compile_parts(system.model)  # while the last step's updates may be in flight
                before, broken = counter.compiles, counter.graph_breaks()
                system.step()
                compiles.append(counter.compiles - before)
                breaks.append(counter.graph_breaks() - broken)
            chooser = getattr(getattr(system.optimizer, "_bytescheduler", None), "chooser", None)
            modes = list(chooser.history) if chooser is not None else None
            results[key] = {"params": system.finish(), "losses": torch.stack(system.losses),
                            "compiles": compiles, "breaks": breaks, "modes": modes}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(results, out / f"{scenario}.rank{rank}.pt")


if __name__ == "__main__":
    main()
