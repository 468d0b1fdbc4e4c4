"""The torch adapters' own errors, and the checks of their arguments."""

from __future__ import annotations

import gc
from typing import Any

import torch

from ..core.errors import ByteSchedulerError


class GradientError(ByteSchedulerError):
    """Gradients were used in a way that would silently train wrong; the message says how to fix it."""


def check_arguments(model: Any, optimizer: Any, backward_passes_per_step: Any) -> None:
    """Refuse arguments that would train wrong or fail later, naming the fix (before any collective)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (the one the optimizer trains), not {type(model).__name__}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be an int of at least 1 "
                         "(the backward passes accumulated before each step)")
    ours = {id(p) for p in model.parameters()}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in ours:
                raise ValueError(
                    f"the optimizer's parameter of shape {tuple(param.shape)} (group {index}) is not a "
                    "parameter of model: pass the model whose parameters the optimizer trains")


def refuse_wrapped(model: torch.nn.Module) -> None:
    """Refuse a model that DistributedDataParallel wraps (or that is a DDP), naming the fix."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "ScheduledOptimizer takes the plain model, not a DistributedDataParallel wrapper "
            "(it communicates the gradients itself); for DDP use the scheduled comm hook instead")
    if ddp_wrapper_of(model) is not None:
        raise TypeError(
            "model is already wrapped in DistributedDataParallel (as Accelerate's prepare() or "
            "Lightning's DDP strategy wrap it), which all-reduces its gradients itself: give "
            "ScheduledOptimizer a model no DDP wraps, or keep the DDP wrapper and register "
            "bytescheduler.pytorch.scheduled_allreduce_hook on it instead")


def ddp_wrapper_of(model: torch.nn.Module) -> Any:
    """The ``DistributedDataParallel`` that wraps ``model``, if one does (found through the
    objects that refer to it: DDP keeps the module in its ``_modules``; three scans of the
    heap, once at construction)."""
    from torch.nn.parallel import DistributedDataParallel

    frontier: list = [model]
    for _ in range(3):
        holders = [h for h in gc.get_referrers(*frontier) if h is not frontier]
        for holder in holders:
            if isinstance(holder, DistributedDataParallel) and holder.module is model:
                return holder
        frontier = [h for h in holders if isinstance(h, dict)]
        if not frontier:
            return None
    return None


def undeclared_sparse(name: str) -> str:
    return (f"parameter {name!r} has a sparse gradient, but no module of the model declares it "
            "sparse (as nn.Embedding(sparse=True) does), so the ranks cannot agree to average it "
            "outside the scheduler: declare it, or make it dense")


AGAIN = (
    "parameter {!r} got another gradient before optimizer.step() while its previous gradient "
    "is being communicated: to accumulate gradients over k backward passes, pass backward_passes_per_step=k"
)
