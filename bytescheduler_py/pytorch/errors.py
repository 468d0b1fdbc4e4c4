"""The torch adapters' own errors, and the checks of their arguments."""

from __future__ import annotations

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


def undeclared_sparse(name: str) -> str:
    return (f"parameter {name!r} has a sparse gradient, but no module of the model declares it "
            "sparse (as nn.Embedding(sparse=True) does), so the ranks cannot agree to average it "
            "outside the scheduler: declare it, or make it dense")


AGAIN = (
    "parameter {!r} got another gradient before optimizer.step() while its previous gradient "
    "is being communicated: to accumulate gradients over k backward passes, pass backward_passes_per_step=k"
)
