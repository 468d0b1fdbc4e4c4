"""The MXNet engine setting ScheduledKVStore needs, without importing MXNet (the launcher
sets it for every process it starts; the store names it when a worker lacks it)."""

from typing import Dict, Optional

# MXNet's engine runs the backward pass in bulks of up to 15 operators (its default), and an
# operator's outputs become readable only when its whole bulk has finished: a layer's
# gradient waits for up to 14 more operators, and on VGG-like the gradients became ready in
# three groups per iteration, so pushes could not overlap most of the backward pass. With
# bulks of one operator each gradient is ready as soon as it is computed; the arithmetic is
# the same (bulking only groups the engine's scheduling). MXNet reads the variable once, when
# it starts, so it has to be in the worker's environment: every process of a launch gets it
# unless it is already set. ScheduledKVStore says so when it is missing (:func:`engine_hint`).
ENGINE_ENV = {"MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD": "1"}
# Every variable that decides how MXNet bulks the backward pass (for reports and tests).
ENGINE_KEYS = ("MXNET_EXEC_BULK_EXEC_TRAIN", *ENGINE_ENV)


def with_engine_env(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` with :data:`ENGINE_ENV`'s settings where ``env`` does not set them (or bulking off)."""
    if env.get("MXNET_EXEC_BULK_EXEC_TRAIN") == "0":
        return env  # no bulks at all: the same effect, the user's choice
    return dict(ENGINE_ENV, **env)


def engine_hint(env: Dict[str, str]) -> Optional[str]:
    """What to set for the backward's gradients to be readable one by one, or None when
    ``env`` (a worker's environment) already sets it (any value: the user's choice) or turns
    bulking off.

    >>> engine_hint({"MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD": "1"}) is None
    True
    >>> engine_hint({})[:44]
    'set MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD='
    """
    if with_engine_env(env) == env:
        return None  # ours, or the user's own choice
    return ("set MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD=1 in the workers' environment before they start "
            "(bytescheduler mxnet-launch does): MXNet's engine otherwise finishes the backward pass in bulks of "
            "15 operators, a gradient is readable only when its bulk is done, and pushes overlap little of "
            "the backward pass (docs/mxnet.md)")
