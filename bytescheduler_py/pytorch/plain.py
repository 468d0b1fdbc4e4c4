"""The plain path: what the framework itself does, for when scheduling does not pay.

DDP averages gradients in fixed buckets, launched in order while backward runs, waits for
them at the end of backward and leaves one full ``optimizer.step()`` to the user;
Horovod's ``DistributedOptimizer`` launches one asynchronous all-reduce per gradient
(its background thread fuses them) and waits in ``step()``. :class:`PlainPath` does the
same for an :class:`~bytescheduler.pytorch.overlap.OverlapEngine` in its plain mode: no
scheduler, no updater thread, no read guard, so it costs about what the framework's own
path costs. The numbers are the same as in the scheduled mode: each gradient is averaged
the same way (the same collective on the same values) and the user's update rule treats
each parameter on its own.

An adapter gives it a :class:`Reducer`, which starts averaging a bucket and waits for it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ..core.errors import as_library_error
from .grad_views import MIN_VIEW_BYTES, split_views
from .unused import FLAGS_KEY


class Reducer(Protocol):
    """Averages buckets of gradients in place (the framework's own collective)."""

    def start(self, items: Sequence[Tuple[int, torch.Tensor]]) -> Any:
        """Begin averaging the ``(key, gradient)`` pairs of one bucket; return a handle."""

    def wait(self, handle: Any, assign: Optional[Callable[[int, torch.Tensor], bool]] = None) -> None:
        """Wait for a bucket begun by :meth:`start`; its gradients then hold the average.

        ``assign(key, view)``, when given, may be called instead of copying an average back:
        ``view`` holds it, and the caller makes it that key's gradient (True) or declines
        (False: then it is copied back)."""


class _Bucket:
    __slots__ = ("index", "keys", "waiting", "handle", "launched")

    def __init__(self, index: int, keys: List[int]) -> None:
        self.index = index
        self.keys = keys
        self.waiting = set(keys)
        self.handle: Any = None
        self.launched = False


def assign_buckets(members: Sequence[Tuple[int, int, Any]], first_bytes: int, bytes_per_bucket: int) -> List[List[int]]:
    """Keys grouped into buckets in the given order (DDP's: reverse forward order).

    ``members`` are ``(key, nbytes, kind)``; a bucket holds one kind (dtype and device) and
    closes once it reaches its size (the first one ``first_bytes``, the others
    ``bytes_per_bucket``); 0 makes each gradient a bucket of its own.

    >>> assign_buckets([(0, 4, "f"), (1, 4, "f"), (2, 8, "f"), (3, 4, "h")], 4, 8)
    [[0], [1, 2], [3]]
    """
    buckets: List[List[int]] = []
    size, kind = 0, None
    for key, nbytes, member_kind in members:
        limit = first_bytes if len(buckets) <= 1 else bytes_per_bucket
        if not buckets or member_kind != kind or size >= limit:
            buckets.append([])
            size, kind = 0, member_kind
        buckets[-1].append(key)
        size += nbytes
    return buckets


class PlainPath:
    """Fixed buckets averaged in order as their gradients become ready, finished at the end of backward.

    Args:
        buckets: keys per bucket, in launch order (the same on every rank).
        reducer: the framework's collective.
        prepare: key -> the parameter's gradient made ready to join a bucket (checked,
            contiguous), or None when the parameter has no gradient; the reducer scales.
        rank: this process's rank, in the :class:`~bytescheduler.core.errors.CommunicationError`
            that a failed collective becomes.
        assign: ``assign(key, view)`` makes ``view`` (the average, in the reducer's buffer)
            that key's gradient, or returns False; None: the reducer copies every average back.
        zeros: key -> a zero gradient, made the parameter's own, for a parameter without one
            when ``step()`` finishes the buckets (every rank's buckets then hold the same
            gradients); None: such a parameter is left out of its bucket.
        unused: with ``zeros``, called at ``step()`` with the keys no rank had a gradient for
            (DDP's rule: they keep none): the last bucket carries one flag per key, 1 where
            this rank had the gradient. None: the zeros stay (Horovod's rule).

    Not thread-safe: the training thread (backward's hooks, ``step``) is its only caller.
    """

    def __init__(self, buckets: List[List[int]], reducer: Reducer,
                 prepare: Callable[[int], Optional[torch.Tensor]], rank: int = 0,
                 assign: Optional[Callable[[int, torch.Tensor], bool]] = None,
                 zeros: Optional[Callable[[int], torch.Tensor]] = None,
                 unused: Optional[Callable[[List[int]], None]] = None) -> None:
        self._buckets = [_Bucket(i, keys) for i, keys in enumerate(buckets)]
        self._bucket_of = {key: bucket for bucket in self._buckets for key in bucket.keys}
        self._reducer = reducer
        self._prepare = prepare
        self._rank = rank
        self._assign = assign
        self._next = 0  # the next bucket to launch
        self._prepared: Dict[int, torch.Tensor] = {}
        self.finished = False  # every bucket averaged during backward (as DDP's end of backward)
        self._zeros = zeros
        self._unused = unused if zeros is not None else None
        self._filled: List[int] = []  # keys given zeros at this step()
        self._flags: Optional[torch.Tensor] = None  # the last bucket's flags, reused
        self._keys = 1 + max((key for keys in buckets for key in keys), default=-1)

    def taken(self, key: int) -> bool:
        """Whether ``key``'s gradient was taken this iteration (another may not be added to it)."""
        return key in self._prepared

    def ready(self, key: int) -> None:
        """``key``'s gradient is complete: prepare it, launch every bucket now complete, in order."""
        grad = self._prepare(key)
        if grad is not None:
            self.add(key, grad)

    def add(self, key: int, grad: torch.Tensor) -> None:
        """:meth:`ready` with the gradient already prepared (the hot path of a backward hook)."""
        self._prepared[key] = grad
        self._bucket_of[key].waiting.discard(key)
        while self._next < len(self._buckets) and not self._buckets[self._next].waiting:
            self._launch(self._buckets[self._next])
        if self._next == len(self._buckets):
            self._wait_all()
            self.finished = True

    def finish(self) -> bool:
        """At ``step()``: launch what backward left (gradients kept from earlier passes, or
        buckets with unused parameters) and wait for everything. Returns False when some
        bucket had to be completed here after a backward pass (an irregular iteration; a
        step without any backward, e.g. Horovod's ``broadcast_optimizer_state``, is not)."""
        regular = self.finished or not self._prepared
        if not self.finished:
            for bucket in self._buckets[self._next:]:
                for key in bucket.keys:
                    if key not in self._prepared:
                        grad = self._prepare(key)
                        if grad is None and self._zeros is not None:
                            grad = self._zeros(key)
                            self._filled.append(key)
                        if grad is not None:
                            self._prepared[key] = grad
                self._launch(bucket)
            self._wait_all()
            if self._filled and self._unused is not None:
                counts = self._flags.tolist()
                unused = [key for key in self._filled if counts[key] <= 0]
                if unused:
                    self._unused(unused)
            self._filled = []
        for bucket in self._buckets:
            bucket.waiting = set(bucket.keys)
            bucket.launched = False
        self._next = 0
        self._prepared = {}
        self.finished = False
        return regular

    def _launch(self, bucket: _Bucket) -> None:
        items = [(key, self._prepared[key]) for key in bucket.keys if key in self._prepared]
        if self._unused is not None and items and bucket.index == len(self._buckets) - 1:
            items.append((FLAGS_KEY, self._flags_for(items[0][1])))
        try:
            bucket.handle = self._reducer.start(items) if items else None
        except Exception as error:  # noqa: BLE001 - a failed collective: a peer died or the network failed
            raise as_library_error(error, self._rank) from error
        bucket.launched = True
        self._next = bucket.index + 1

    def _flags_for(self, like: torch.Tensor) -> torch.Tensor:
        """1 for each key this rank has a gradient for, 0 for those given zeros (any dtype
        holds a sum of 0s and 1s that is positive exactly when one was 1)."""
        flags = self._flags
        if flags is None or flags.dtype != like.dtype or flags.device != like.device:
            flags = self._flags = torch.empty(self._keys, dtype=like.dtype, device=like.device)
        flags.fill_(1)
        if self._filled:
            flags[self._filled] = 0
        return flags

    def wait_launched(self) -> None:
        """Wait for the buckets launched so far (closing between backward and ``step()``)."""
        self._wait_all()

    def _wait_all(self) -> None:
        for bucket in self._buckets:
            if bucket.handle is not None:
                handle, bucket.handle = bucket.handle, None
                try:
                    self._reducer.wait(handle, self._assign)
                except Exception as error:  # noqa: BLE001 - as in _launch
                    raise as_library_error(error, self._rank) from error


class FlatReducer:
    """:class:`Reducer` for torch.distributed: each bucket's gradients divided by the world
    size and all-reduced (summed) on ``group``, a bucket of several copied into one flat
    buffer, as DDP does without ``gradient_as_bucket_view``. One kernel per bucket for the
    division and one call for each copy, not one per gradient: on a small model the
    launches, not the bytes, are the cost. The averages of large gradients are handed over
    as views of the buffer (``assign``, :mod:`~bytescheduler.pytorch.grad_views`) rather
    than copied back; a gradient that is such a view already (the next backward
    accumulated into it) is not copied in either."""

    def __init__(self, group: Any, world_size: int) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._world_size = world_size
        # keys -> (flat buffer, its views shaped as the gradients): kept, as DDP keeps its buckets
        self._buffers: Dict[Tuple[int, ...], Tuple[torch.Tensor, List[torch.Tensor]]] = {}

    def start(self, items: Sequence[Tuple[int, torch.Tensor]]) -> Any:
        keys = tuple(key for key, _ in items)
        grads = [grad for _, grad in items]
        views: Optional[List[torch.Tensor]] = None
        if len(grads) == 1:
            flat = grads[0].view(-1)
        else:
            flat, views = self._buffer(keys, grads)
            loose = [index for index, (grad, view) in enumerate(zip(grads, views)) if grad is not view]
            if len(loose) == len(grads):
                torch.cat([grad.view(-1) for grad in grads], out=flat)
            elif loose:  # cat cannot write a buffer that some of its inputs live in
                torch._foreach_copy_([views[i] for i in loose], [grads[i] for i in loose])
        flat.div_(self._world_size)
        work = self._dist.all_reduce(flat, group=self._group, async_op=True)
        return work, keys, grads, views

    def _buffer(self, keys: Tuple[int, ...], grads: List[torch.Tensor]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        known = self._buffers.get(keys)
        first = grads[0]
        if known is not None:
            flat, views = known
            if (flat.dtype == first.dtype and flat.device == first.device
                    and all(view.shape == grad.shape for view, grad in zip(views, grads))):
                return known
        flat = torch.empty(sum(grad.numel() for grad in grads), dtype=first.dtype, device=first.device)
        known = self._buffers[keys] = (flat, split_views(flat, grads))
        return known

    def wait(self, handle: Any, assign: Optional[Callable[[int, torch.Tensor], bool]] = None) -> None:
        work, keys, grads, views = handle
        work.wait()
        if views is None:
            return
        back_to, back_from = [], []
        for key, grad, view in zip(keys, grads, views):
            if grad is view:
                continue
            if not (assign is not None and view.numel() * view.element_size() >= MIN_VIEW_BYTES
                    and assign(key, view)):
                back_to.append(grad)
                back_from.append(view)
        if back_to:
            torch._foreach_copy_(back_to, back_from)


def torch_agreement(group: Any, backend: str) -> Callable[[int, bool], int]:
    """The mode switch's agreement over torch.distributed: one all-reduce (max) of
    [rank 0's proposal, veto] on ``group`` (a lane, idle whenever this is called)."""
    import torch.distributed as dist

    from ..core.modes import STOP

    def agree(proposal: int, veto: bool) -> int:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        votes = torch.tensor([proposal, int(veto)], dtype=torch.int64, device=device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
        return STOP if int(votes[1]) else int(votes[0])

    return agree
