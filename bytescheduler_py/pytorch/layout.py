"""What the ranks compare of a model before training: its parameter layout."""

from __future__ import annotations

from typing import List

import torch

from ..core.agreement import ParamInfo
from .sparse import sparse_ids


def param_layout(model: torch.nn.Module) -> List[ParamInfo]:
    """What the ranks compare of a model: each parameter's name, shape, dtype and whether its
    gradient will be sparse (an ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``)."""
    sparse = sparse_ids(model)
    return [(name, tuple(p.shape), str(p.dtype).replace("torch.", ""), id(p) in sparse)
            for name, p in model.named_parameters()]
