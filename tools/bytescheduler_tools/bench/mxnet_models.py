"""Gluon versions of the benchmark models of :mod:`bytescheduler_tools.bench.models` (same layers, same shapes).

Imports MXNet, never torch (MXNet lives in its own environment). Each builder returns
``(net, make_batch)``; ``make_batch(batch_size, seed)`` gives ``(inputs, labels)`` NDArrays of
synthetic data (32x32 RGB images, 10 classes), like the torch models' batches.

    >>> net, make_batch = build("vgg")           # doctest: +SKIP
    >>> sum(p.data().size for p in net.collect_params().values())  # doctest: +SKIP
    30538314
"""

from __future__ import annotations

from typing import Callable, Tuple

import mxnet as mx
import numpy as np
from mxnet.gluon import nn

Batch = Callable[[int, int], Tuple[mx.nd.NDArray, mx.nd.NDArray]]

MODELS = ("vgg", "vgg-small", "cnn-small", "mlp", "tiny")


def _images(batch_size: int, seed: int):
    rng = np.random.RandomState(seed)
    x = rng.standard_normal((batch_size, 3, 32, 32)).astype(np.float32)
    return mx.nd.array(x), mx.nd.array(rng.randint(0, 10, (batch_size,)))


def vgg_like(width: int = 64, hidden: int = 2048, fc_layers: int = 6) -> nn.Sequential:
    """conv [w, w, M, 2w, 2w, M, 4w, 4w, M] + ``fc_layers`` hidden Dense layers + a classifier."""
    net, channels = nn.Sequential(), 3
    for out in (width, width, "M", 2 * width, 2 * width, "M", 4 * width, 4 * width, "M"):
        if out == "M":
            net.add(nn.MaxPool2D(2))
        else:
            net.add(nn.Conv2D(out, 3, padding=1, in_channels=channels, activation="relu"))
            channels = out
    net.add(nn.Flatten(), nn.Dense(hidden, in_units=channels * 4 * 4, activation="relu"))
    for _ in range(fc_layers - 1):
        net.add(nn.Dense(hidden, in_units=hidden, activation="relu"))
    net.add(nn.Dense(10, in_units=hidden))
    return net


def mlp(width: int = 2048, layers: int = 8) -> nn.Sequential:
    """3072 -> ``layers`` x Dense(width) -> 10."""
    net, features = nn.Sequential(), 3 * 32 * 32
    net.add(nn.Flatten())
    for _ in range(layers):
        net.add(nn.Dense(width, in_units=features, activation="relu"))
        features = width
    net.add(nn.Dense(10, in_units=features))
    return net


def build(name: str) -> Tuple[nn.Sequential, Batch]:
    """A model by name (one of :data:`MODELS`), not yet initialised."""
    if name == "vgg":
        return vgg_like(), _images
    if name == "vgg-small":
        return vgg_like(width=32, hidden=1024, fc_layers=4), _images
    if name == "cnn-small":
        return vgg_like(width=8, hidden=128, fc_layers=3), _images
    if name == "mlp":
        return mlp(), _images
    if name == "tiny":
        net = nn.Sequential()
        net.add(nn.Flatten(), nn.Dense(64, in_units=3072, activation="relu"), nn.Dense(10, in_units=64))
        return net, _images
    raise ValueError(f"model {name!r} has no MXNet version: use one of {', '.join(MODELS)}")


def shapes(name: str) -> list:
    """Parameter shapes in layer order (weights as (out, in, ...), like torch's)."""
    net, _ = build(name)
    return [tuple(p.shape) for p in net.collect_params().values()]
