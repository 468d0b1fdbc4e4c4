"""The peer-parity scenarios: training loops modelled on what PyTorch's DDP tests and
Horovod's DistributedOptimizer tests check, each run with the framework's own path and
with ours, side by side in one process per rank, from the same weights and batches.

A scenario names a model, how each rank's forward uses it at each step (a parameter
skipped on one rank, on every rank, experts routed by the data), an optimizer and the
options of our adapter. :func:`train_pair` runs one and returns what differs
(:func:`differences`); ``tests/test_peer_parity.py`` asserts that nothing does.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 12
BATCH = 4
VOCAB = 12  # tokens of the token models


# --------------------------------------------------------------------------- models


class Branchy(nn.Module):
    """An MLP whose forward may skip ``fc1`` and ``fc2`` (conditional computation)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(8, 16)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, skip=()) -> torch.Tensor:
        x = torch.relu(self.fc0(x))
        if "fc1" not in skip:
            x = torch.relu(self.fc1(x))
        if "fc2" not in skip:
            x = torch.relu(self.fc2(x))
        return self.out(x)


class Experts(nn.Module):
    """Top-1 routing over three experts by a fixed rule on the data: an expert no sample of
    this rank's batch goes to gets no gradient here (mixture-of-experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, skip=()) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        route = (x[:, 0] * 3).floor().clamp(-1, 1).long() + 1
        mixed = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            chosen = (route == index).nonzero().flatten()
            if chosen.numel():
                mixed = mixed.index_add(0, chosen, expert(h[chosen]))
        return self.out(mixed)


class ConvBN(nn.Module):
    """Two convolutions with BatchNorm (running statistics as buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, skip=()) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


class Tied(nn.Module):
    """A language-model head tied to its embedding (one parameter used twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, skip=()) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(x))))


class TwoDtypes(nn.Module):
    """A float64 layer before a float32 one (buckets and merges split by dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(8, 16).double()
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, skip=()) -> torch.Tensor:
        return self.out(torch.relu(self.wide(x.double())).float())


class HuggingFace(nn.Module):
    """A Hugging Face GPT-2 or BERT built from its config (tests/hf_models.py), dropout off;
    ``forward`` returns its logits."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        from tests import hf_models  # imports transformers: only where a scenario uses it

        self.inner = getattr(hf_models, kind)(VOCAB, dropout=False)

    def forward(self, x: torch.Tensor, skip=()) -> torch.Tensor:
        return self.inner(input_ids=x).logits


MODELS: Dict[str, Callable[[], nn.Module]] = {
    "branchy": Branchy, "experts": Experts, "convbn": ConvBN, "tied": Tied, "two-dtypes": TwoDtypes,
    "hf-gpt2": lambda: HuggingFace("gpt2"), "hf-bert": lambda: HuggingFace("bert"),
}
TOKENS = ("tied", "hf-gpt2", "hf-bert")  # models of token sequences, VOCAB tokens


def batch(model: str, rank: int, step: int, micro: int = 0):
    """(input, target) of ``rank`` at ``step``: different on each rank, the same for both runs."""
    generator = torch.Generator().manual_seed(10_000 * rank + 10 * step + micro)
    if model == "convbn":
        x = torch.randn(BATCH, 3, 6, 6, generator=generator)
    elif model in TOKENS:
        x = torch.randint(0, VOCAB, (BATCH, 5), generator=generator)
        return x, torch.randint(0, VOCAB, (BATCH, 5), generator=generator)
    else:
        x = torch.randn(BATCH, 8, generator=generator)
    return x, torch.randint(0, 3, (BATCH,), generator=generator)


def loss_of(model: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if model in TOKENS:
        return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
    return F.cross_entropy(output, target)


# --------------------------------------------------------------------------- who skips what


def skips(plan: str, rank: int, step: int) -> tuple:
    """The layers ``rank``'s forward skips at ``step`` under ``plan``."""
    if plan == "one-rank":  # fc1: unused on one rank at a time, used on the others
        return ("fc1",) if (step + rank) % 2 == 0 else ()
    if plan == "all-ranks":  # and now and then unused on every rank (fc2 every third step)
        skipped = []
        if (step + rank) % 2 == 0 or step % 4 == 1:
            skipped.append("fc1")
        if step % 3 == 0:
            skipped.append("fc2")
        return tuple(skipped)
    if plan == "rank0":  # unused on rank 0 only: rank 0 must learn that another rank used it
        return ("fc1",) if rank == 0 and step % 2 == 0 else ()
    return ()


# --------------------------------------------------------------------------- optimizers


OPTIMIZERS: Dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9, nesterov=True),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.01),
    "adadelta": lambda params: torch.optim.Adadelta(params, lr=0.5),
    "adamax": lambda params: torch.optim.Adamax(params, lr=1e-3),
}


@dataclass
class Scenario:
    """One training loop (see the module docstring)."""

    name: str
    model: str = "branchy"
    plan: str = "none"
    optimizer: str = "sgd"
    ours: Dict[str, Any] = field(default_factory=dict)  # our adapter's options
    theirs: Dict[str, Any] = field(default_factory=dict)  # the framework's (DDP's) options
    passes: int = 1  # backward passes per step (accumulation)
    set_to_none: bool = True
    evaluate: bool = False  # a forward without gradients between steps
    checkpoint: bool = False  # save and load both optimizers' state in the middle
    clip: bool = False  # clip_grad_norm_ before each step
    schedule: bool = False  # a StepLR schedule
    channels_last: bool = False
    steps: int = STEPS
    join: str = ""  # uneven inputs under Join: "first" (rank 0 runs out first), "last", or "even" (as many steps)
    epochs: int = 1  # Horovod: epochs of uneven inputs, each ending in hvd.join()


def steps_of(scenario: Scenario, rank: int, world_size: int) -> int:
    """How many steps ``rank`` runs: all of them, or fewer under ``join`` (uneven inputs)."""
    if scenario.join == "first":
        return scenario.steps - 2 * (world_size - 1 - rank)
    if scenario.join == "last":
        return scenario.steps - 2 * rank
    return scenario.steps


# Scheduled path with small pieces and credit (every gradient cut and merged), or the plain
# path from the start, or the mode switch's defaults.
SCHEDULED = dict(adaptive=False, partition_bytes=256, credit_bytes=1024)
PLAIN = dict(adaptive=True, start_plain=True)


def differences(ours: nn.Module, theirs: nn.Module, tolerance: float = 0.0) -> List[str]:
    """What differs between two models: parameters, gradients (and whether there is one),
    buffers; exact with ``tolerance`` 0, else relative to the largest value."""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        if tolerance == 0.0:
            return torch.equal(a, b)
        scale = max(a.abs().max().item() if a.numel() else 0.0, 1e-12)
        return a.shape == b.shape and bool(((a.double() - b.double()).abs() <= tolerance * scale).all())

    found = []
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        if not close(a.detach(), b.detach()):
            found.append(f"parameter {name}")
        if (a.grad is None) != (b.grad is None):
            found.append(f"gradient {name}: {'none' if a.grad is None else 'one'} here, "
                         f"{'none' if b.grad is None else 'one'} there")
        elif a.grad is not None and not close(a.grad, b.grad):
            found.append(f"gradient {name}")
    for (name, a), (_, b) in zip(ours.named_buffers(), theirs.named_buffers()):
        if not close(a.double() if a.is_floating_point() else a, b.double() if b.is_floating_point() else b):
            found.append(f"buffer {name}")
    return found


def seeded(scenario: Scenario) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[scenario.model]()
    if scenario.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def run_loop(scenario: Scenario, rank: int, model: nn.Module, forward: nn.Module, optimizer: Any,
             synchronize: Callable[[], None], no_sync: Optional[Callable[[], Any]] = None,
             after_backward: Optional[Callable[[], None]] = None, world_size: Optional[int] = None) -> List[float]:
    """Train ``forward`` (``model`` itself or its wrapper) with ``optimizer``; the losses.

    ``no_sync``: the framework's way to accumulate without communicating (DDP's context
    manager) for all but the last of ``passes`` backward passes; ``after_backward``: run
    before ``step()`` (Horovod's ``synchronize`` before clipping); ``world_size``: for the
    steps of a rank under ``join``, where torch.distributed is not initialised (Horovod)."""
    import contextlib

    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5) if scenario.schedule else None
    losses: List[float] = []
    import torch.distributed as dist

    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    steps = steps_of(scenario, rank, world_size)
    for step in range(steps):
        if scenario.set_to_none:
            optimizer.zero_grad()  # Horovod's takes no argument
        else:
            optimizer.zero_grad(set_to_none=False)
        for micro in range(scenario.passes):
            x, y = batch(scenario.model, rank, step, micro)
            if scenario.channels_last:
                x = x.to(memory_format=torch.channels_last)
            quiet = no_sync() if no_sync is not None and micro < scenario.passes - 1 else contextlib.nullcontext()
            with quiet:
                loss = loss_of(scenario.model, forward(x, skips(scenario.plan, rank, step)), y)
                loss.backward()
            losses.append(loss.item())
        if after_backward is not None:
            after_backward()
        if scenario.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        if scenario.evaluate:
            with torch.no_grad():
                forward(*[batch(scenario.model, rank, 1000 + step)[0]])
        if scenario.checkpoint and step == scenario.steps // 2:
            buffer = io.BytesIO()
            torch.save(optimizer.state_dict(), buffer)
            buffer.seek(0)
            optimizer.load_state_dict(torch.load(buffer, weights_only=False))
    synchronize()
    return losses
