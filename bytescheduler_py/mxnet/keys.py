"""The key layout: how a user's keys live on the parameter servers, as sub-keys of one grain.

A key larger than ``grain_bytes`` lives on the servers as *sub-keys* of at most ``grain_bytes``
each (ints ``SUBKEY_BASE + n`` for int keys, ``"<key>#bs<j>"`` for str keys), initialised
collectively when the key is ``init``-ed or ``broadcast``. The grain is fixed for the run: the
servers keep state per key (the value and, with ``update_on_kvstore``, the optimizer's
momentum), which new keys would start without. The scheduler sees such a key as a tensor with
one element per sub-key (:meth:`KeyInfo.task`), so every piece it cuts is a run of whole
sub-keys, sent with one list-of-keys call. Changing the partition size therefore only regroups
sub-keys and never touches server state; sizes below the grain are refused. The default grain
is the initial ``partition_bytes``: each sub-key costs the servers a request and an optimizer
call per step, so smaller grains are slower (docs/mxnet.md).

The servers' optimizer sees a sub-key as a key of its own: :meth:`KeyLayout.server_optimizer`
gives every sub-key its parent's ``lr_mult``, ``wd_mult`` and name, and per-tensor-norm
optimizers (LARS, LAMB), which would be wrong across sub-keys, are refused
(:func:`check_optimizer`).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import mxnet as mx
import numpy as np

from ..core.partition import partition_ranges
from ..core.task import Task

# Int sub-keys start here; user int keys must stay below. ps-lite maps a key to a server with
# ``key * 9973`` in a 32-bit int, so keys must stay below about 215,000.
SUBKEY_BASE = 100_000
_MAX_INT_KEY = (2**31 - 1) // 9973
# Reserved keys that carry rank 0's ordering address (int or str, as the user's keys).
ORDER_KEY_INT = _MAX_INT_KEY
ORDER_KEY_STR = "__bytescheduler_order__"
# Reserved int keys just below it, one per decision of the mode switch (mxnet/plain.py):
# a key cannot be initialised twice.
DECISION_KEYS = 16_384
# Then the link probe's key and the key that carries rank 0's grain (mxnet/grain.py), the
# first init's. Sub-keys stay below them all.
PROBE_KEY_INT = ORDER_KEY_INT - DECISION_KEYS - 1
GRAIN_KEY_INT = ORDER_KEY_INT - DECISION_KEYS - 2
_SUBKEY_LIMIT = GRAIN_KEY_INT
_RESERVED_STR = {"order": ORDER_KEY_STR, "probe": "__bytescheduler_probe__", "grain": "__bytescheduler_grain__"}
_RESERVED_INT = {"order": ORDER_KEY_INT, "probe": PROBE_KEY_INT, "grain": GRAIN_KEY_INT}

_NORM_OPTIMIZERS = ("lars", "lamb")
# Checked arrays a key remembers (gluon uses two or three per key: gradient, weight, copies per device).
_CHECKED_ARRAYS = 8


def as_list(value: Any) -> List[Any]:
    """``value`` as a list: itself when it is a list or tuple, else a list of one."""
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def key_pairs(key: Any, value: Any) -> List[Tuple[Any, Any]]:
    """Split a key list into (key, value) pairs (value: NDArray or list of NDArrays)."""
    if isinstance(key, (list, tuple)):
        values = as_list(value)
        if len(values) != len(key):
            raise ValueError(f"{len(key)} keys but {len(values)} values")
        return list(zip(key, values))
    return [(key, value)]


def flat(arr: Any, start: int, stop: int) -> Any:
    """A view of the elements ``[start, stop)`` of ``arr`` (reshape and axis-0 slices are views)."""
    whole = arr.reshape(-1)
    if start == 0 and stop == whole.shape[0]:
        return whole
    return whole[start:stop]


def rank0_words(inner: Any, key: Any, words: Sequence[float]) -> List[float]:
    """Rank 0's ``words`` (float32) on every worker of ``inner``, a dist store: every worker
    ``init``-s the reserved ``key`` (collective; only rank 0's value is kept) and pulls it."""
    inner.init(key, mx.nd.array(list(words), dtype="float32"))
    found = mx.nd.zeros((len(words),), dtype="float32")
    inner.pull(key, out=found)
    return [float(x) for x in found.asnumpy()]


def rank0_json(inner: Any, key: Any, value: Any, size: int) -> Any:
    """Rank 0's ``value`` (JSON-able; ignored elsewhere) on every worker, through the reserved
    ``key`` as one float32 per byte of its JSON, at most ``size`` bytes (see :func:`rank0_words`)."""
    words = [0.0] * (1 + size)
    if inner.rank == 0:
        encoded = json.dumps(value).encode()
        if len(encoded) > size:
            raise ValueError(f"rank 0's {key!r} takes {len(encoded)} bytes, more than {size}")
        words[:1 + len(encoded)] = [len(encoded)] + list(encoded)
    found = [int(x) for x in rank0_words(inner, key, words)]
    return json.loads(bytes(found[1:1 + found[0]]).decode())


def mx_args(keys: Sequence[Any], arrays: List[List[Any]]) -> Tuple[Any, Any]:
    """MXNet's argument form: one key and its array(s), or a list of keys and one entry per key."""
    entries = [group[0] if len(group) == 1 else group for group in arrays]
    if len(keys) == 1:
        return keys[0], entries[0]
    return list(keys), entries


def check_arrays(key: Any, arrays: Iterable[Any], shape: Sequence[int], dtype: Any, what: str) -> None:
    """Every array is a dense NDArray of the key's shape and dtype; ``what`` names it in errors."""
    for arr in arrays:
        if not isinstance(arr, mx.nd.NDArray):
            raise TypeError(f"{what} for key {key!r} must be an NDArray, not {type(arr).__name__}")
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"{what} for key {key!r} has shape {tuple(arr.shape)} but the key "
                             f"was initialised with shape {tuple(shape)}")
        if np.dtype(arr.dtype) != np.dtype(dtype):
            raise ValueError(f"{what} for key {key!r} has dtype {np.dtype(arr.dtype)} but the key "
                             f"was initialised with dtype {np.dtype(dtype)}")
        if arr.stype != "default":
            raise NotImplementedError("ScheduledKVStore supports dense arrays only")


def check_optimizer(optimizer: Any, infos: Iterable["KeyInfo"]) -> None:
    """Refuse an optimizer that computes per-tensor norms when one of ``infos`` is split."""
    if optimizer is None:
        return
    if type(optimizer).__name__.lower() in _NORM_OPTIMIZERS and any(i.partitioned for i in infos):
        raise ValueError(
            f"{type(optimizer).__name__} computes per-tensor norms, which would be wrong on the "
            "servers for a tensor split into pieces; raise grain_bytes (and partition_bytes) above "
            "the largest parameter, or use update_on_kvstore=False")


class KeyInfo:
    """What the store knows about one user key: its shape and its sub-keys on the servers."""

    __slots__ = ("key", "index", "shape", "dtype", "numel", "itemsize", "grains", "subkeys", "last", "_checked",
                 "_views")

    def __init__(self, key, index: int, shape, dtype, grains: List[Tuple[int, int]], subkeys: List[Any]) -> None:
        self.key = key
        self.index = index  # the core Task key
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.numel = int(np.prod(self.shape)) if self.shape else 1
        self.itemsize = self.dtype.itemsize
        self.grains = grains  # element range of each sub-key, in order
        self.subkeys = subkeys  # the store key of each grain
        self.last: Any = None  # the key's latest operation (a backend Job), None before the first
        # Arrays already checked, by id, holding them (an id is not reused while the array lives):
        # gluon passes the same gradient and weight arrays every step, and an NDArray's shape and
        # dtype never change, so each is checked once (a few MXNet calls, on every call otherwise).
        self._checked: Dict[int, Any] = {}
        self._views: Dict[int, Tuple[Any, List[Any]]] = {}  # id -> (array, its view per sub-key)

    @property
    def partitioned(self) -> bool:
        return len(self.grains) > 1

    def check(self, arrays: Iterable[Any], what: str) -> None:
        """Every array has the key's shape and dtype (see :func:`check_arrays`)."""
        checked = self._checked
        unknown = [arr for arr in arrays if checked.get(id(arr)) is not arr]
        if unknown:
            check_arrays(self.key, unknown, self.shape, self.dtype, what)
            if len(checked) + len(unknown) > _CHECKED_ARRAYS:
                checked.clear()  # arrays made afresh each call: let go of them
            checked.update((id(arr), arr) for arr in unknown)

    def views(self, arr: Any) -> List[Any]:
        """A flat view of ``arr`` per sub-key (``[start, stop)`` of :attr:`grains`), made once
        per array: gluon passes the same gradient and weight arrays every step, and each view
        costs MXNet a reshape or a slice in Python (tens of microseconds, milliseconds per step
        over a model's sub-keys). A view shares its array's memory and engine variable, so it
        stays valid as long as the array (which the cache holds)."""
        entry = self._views.get(id(arr))
        if entry is None or entry[0] is not arr:
            if len(self._views) >= _CHECKED_ARRAYS:
                self._views.clear()  # arrays made afresh each call: let go of them
            entry = (arr, [flat(arr, start, stop) for start, stop in self.grains])
            self._views[id(arr)] = entry
        return entry[1]

    def groups(self, arrays: Sequence[Any], first: int = 0, stop: Optional[int] = None) -> List[List[Any]]:
        """Per sub-key of ``[first, stop)`` (default: all), the views of each of ``arrays`` (:meth:`views`)."""
        views = [self.views(arr) for arr in arrays]
        return [[arr_views[j] for arr_views in views] for j in range(first, len(self.subkeys) if stop is None else stop)]

    def task(self, payload: Any, priority: float) -> Task:
        """The scheduler's view of the key: one element per sub-key (a piece is a run of them)."""
        first, stop = self.grains[0]
        return Task(self.index, len(self.grains), (stop - first) * self.itemsize, priority, payload,
                    name=f"key{self.key}")


class KeyLayout:
    """Every key of one store, in registration order, and the sub-keys they use on the servers.

    Registration is collective on a dist store, like ``init``: every worker registers the same
    keys in the same order, so they allocate the same sub-keys and the same task indices.
    """

    def __init__(self, grain_bytes: Optional[int]) -> None:
        self.grain_bytes = grain_bytes  # None until decided (mxnet/grain.py), before the first key
        self._keys: Dict[Any, KeyInfo] = {}
        self._kind: Optional[type] = None  # int or str, once the first key is registered
        self._next_subkey = SUBKEY_BASE

    def infos(self) -> List[KeyInfo]:
        """Every registered key, in registration order."""
        return list(self._keys.values())

    def decide(self, grain_bytes: int) -> None:
        """Fix the grain (before the first key is registered)."""
        if self._keys:
            raise RuntimeError("the grain is fixed once keys exist")
        self.grain_bytes = grain_bytes

    @staticmethod
    def reserved_key(name: str, kind: Optional[type]) -> Any:
        """The reserved key ``name`` (``"order"``: rank 0's ordering address and settings;
        ``"probe"``, ``"grain"``: the first init's link probe and rank 0's grain) of the user's
        key type ``kind`` (MXNet cannot mix int and str keys; None: int)."""
        return (_RESERVED_STR if kind is str else _RESERVED_INT)[name]

    def check_keys(self, keys: Sequence[Any]) -> Optional[type]:
        """Check the keys' types and range (every key of a call, before anything is done).

        Returns their type (int or str), None for no keys.
        """
        kinds = set()
        for key in keys:
            if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer, str)):
                raise TypeError(f"kvstore keys are int or str, not {type(key).__name__} ({key!r})")
            kind = str if isinstance(key, str) else int
            if kind is int and not 0 <= int(key) < SUBKEY_BASE:
                raise ValueError(f"int key {key} out of range: ScheduledKVStore needs int keys in "
                                 f"[0, {SUBKEY_BASE}) (sub-keys of partitioned tensors use the keys above)")
            kinds.add(kind)
        known = {self._kind} if self._kind is not None else set()
        if len(kinds | known) > 1:
            used = f"this store already uses {self._kind.__name__} keys" if known else "the keys differ"
            raise TypeError(f"keys {list(keys)!r} mix int and str ({used}); MXNet cannot mix int and str keys")
        return kinds.pop() if kinds else None

    def info(self, key: Any) -> KeyInfo:
        """The registered key ``key``; ``KeyError`` when it was not initialised."""
        self.check_keys([key])
        info = self._keys.get(key if isinstance(key, str) else int(key))
        if info is None:
            raise KeyError(f"key {key!r} was not initialised: call init(key, value) or broadcast first")
        return info

    def check_new(self, pairs: List[Tuple[Any, Any]]) -> Tuple[Optional[type], List[Any]]:
        """Check every new (key, value) of a call; return their type (int, str, None for no
        keys) and the keys as stored. Records nothing."""
        kind = self.check_keys([key for key, _ in pairs])
        keys = [key if isinstance(key, str) else int(key) for key, _ in pairs]
        for key, (_, value) in zip(keys, pairs):
            if key in self._keys or keys.count(key) > 1:
                raise ValueError(f"key {key!r} was already initialised" if key in self._keys
                                 else f"key {key!r} appears twice in one call")
            if not isinstance(value, mx.nd.NDArray):
                raise TypeError(f"value for key {key!r} must be an NDArray, not {type(value).__name__}")
            if value.stype != "default":
                raise NotImplementedError("ScheduledKVStore supports dense arrays only")
        return kind, keys

    def register(self, pairs: List[Tuple[Any, Any]], sent_optimizer: Any = None) -> List[KeyInfo]:
        """Check every new (key, value) of a call, then record them all with their sub-keys.

        Nothing is recorded when one is wrong, including a split key that
        ``sent_optimizer`` (the one the servers already run, if any) cannot update.
        """
        if self.grain_bytes is None:
            raise RuntimeError("the grain is not decided yet")
        kind, keys = self.check_new(pairs)
        infos = []
        for key, (_, value) in zip(keys, pairs):
            numel = int(np.prod(value.shape)) if value.shape else 1
            grains = partition_ranges(numel, np.dtype(value.dtype).itemsize, self.grain_bytes) or [(0, numel)]
            info = KeyInfo(key, len(self._keys) + len(infos), value.shape, value.dtype, grains,
                           self._new_subkeys(key, len(grains)))
            check_optimizer(sent_optimizer, [info])
            infos.append(info)
        self._kind = kind or self._kind
        for info in infos:
            self._keys[info.key] = info
        return infos

    def _new_subkeys(self, key: Any, count: int) -> List[Any]:
        if count == 1:
            return [key]
        if isinstance(key, str):
            return [f"{key}#bs{j}" for j in range(count)]
        if self._next_subkey + count - 1 >= _SUBKEY_LIMIT:
            raise ValueError(f"too many server sub-keys (int keys must stay below {_SUBKEY_LIMIT}); "
                             "raise grain_bytes")
        first, self._next_subkey = self._next_subkey, self._next_subkey + count
        return list(range(first, first + count))

    def decision_key(self, number: int) -> Any:
        """The reserved key of the mode switch's decision ``number`` (0 to
        :data:`DECISION_KEYS` - 1 for int keys), of the user's key type."""
        if self._kind is str:
            return f"__bytescheduler_mode_{number}__"
        if not 0 <= number < DECISION_KEYS:
            raise ValueError(f"decision {number} is beyond the {DECISION_KEYS} reserved keys")
        return ORDER_KEY_INT - 1 - number

    @property
    def str_keys(self) -> bool:
        return self._kind is str

    @staticmethod
    def init_args(infos: List[KeyInfo], values: List[Any]) -> Tuple[Any, Any]:
        """The arguments of the one collective ``init`` that creates these keys' sub-keys."""
        keys, arrays = [], []
        for info, value in zip(infos, values):
            keys.extend(info.subkeys)
            arrays.extend([flat(value, start, stop)] for start, stop in info.grains)
        return mx_args(keys, arrays)

    def server_optimizer(self, optimizer: Any) -> Any:
        """A copy whose multipliers cover every sub-key as they cover the parent key on a server."""
        server = copy.copy(optimizer)
        server.lr_mult = dict(optimizer.lr_mult)
        server.wd_mult = dict(optimizer.wd_mult)
        server.idx2name = dict(optimizer.idx2name)
        for info in self._keys.values():
            # Exactly what a server sees for the parent key: gluon's param_dict is not pickled,
            # so (as without bytescheduler) only lr_mult, wd_mult and idx2name reach it.
            for sub in info.subkeys:
                if info.key in optimizer.lr_mult:
                    server.lr_mult[sub] = optimizer.lr_mult[info.key]
                if info.key in optimizer.wd_mult:
                    server.wd_mult[sub] = optimizer.wd_mult[info.key]
                if info.key in optimizer.idx2name:
                    server.idx2name[sub] = optimizer.idx2name[info.key]
        return server
