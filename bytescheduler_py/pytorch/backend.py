"""The torch.distributed backend: all-reduce each operation on its lane.

:class:`AllReduceBackend` implements the core's
:class:`~bytescheduler.core.backend.Backend` over the lanes of
:class:`~bytescheduler.pytorch.groups.ProcessGroups`: a single piece is reduced in place
(a ``narrow`` view of the flat gradient); several fused pieces are copied into one buffer
(reused: :mod:`~bytescheduler.pytorch.fusion`) and back. Completion comes from the
collective's future, on gloo's thread.

CUDA tensors (NCCL) are supported by design but untested here (no GPU on our machines):
each launch waits on the event recorded when the tensor became ready, and completion is
learned from an event recorded after the collective, by one waiter thread per lane.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core.backend import Done
from ..core.task import Operation
from .fusion import FusionBuffers
from .groups import NUM_LANES, ProcessGroups


def _view(piece) -> torch.Tensor:
    return piece.task.payload.narrow(0, piece.start, piece.stop - piece.start)


class _CudaCompletion:
    """Learns when CUDA collectives finish: one thread per lane waits on events in order.

    Operations of one NCCL communicator run in issue order, so waiting in order is exact.
    """

    def __init__(self, lane: int) -> None:
        self._queue: "queue.SimpleQueue[Optional[Tuple[Any, Done]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"bytescheduler-cuda-lane{lane}", daemon=True)
        self._thread.start()

    def put(self, event: Any, done: Done) -> None:
        self._queue.put((event, done))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, done = item
            try:
                event.synchronize()
            except BaseException as error:  # noqa: BLE001
                done(error)
                continue
            done(None)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


class AllReduceBackend:
    """All-reduces (sums) each operation on its lane of ``groups``; see the module docstring.

    >>> backend = AllReduceBackend(ProcessGroups.claim())                    # doctest: +SKIP
    >>> scheduler = Scheduler(backend, channel=groups.order, rank=groups.rank)  # doctest: +SKIP
    """

    num_lanes = NUM_LANES

    def __init__(self, groups: ProcessGroups) -> None:
        self._lanes = groups.lanes
        self._keeper = groups.keeper
        self._fusion = FusionBuffers()
        self._cuda: Dict[int, _CudaCompletion] = {}
        self._cuda_lock = threading.Lock()

    def launch(self, op: Operation, done: Done) -> None:
        pieces = op.pieces
        views = [_view(piece) for piece in pieces]
        first = views[0]
        if first.is_cuda:
            self._launch_cuda(op, views, done)
            return
        fused = len(views) > 1
        if fused:
            tensor = self._fusion.take(sum(v.numel() for v in views), first.dtype, first.device)
            torch.cat(views, out=tensor)
        else:
            tensor = first
        work = dist.all_reduce(tensor, group=self._lanes[op.lane], async_op=True)
        self._keeper.watch(tensor)

        def finish(future: torch.futures.Future) -> None:
            try:
                future.wait()
                if fused:
                    self._scatter(tensor, views, pieces)
                    self._fusion.give_back(tensor)
            except BaseException as error:  # noqa: BLE001
                # Without its traceback: that would hold this frame, and through it the
                # tensor and this callback, for as long as the scheduler keeps the error
                # to raise it, and the Keeper would wait for them in vain.
                done(error.with_traceback(None))
                return
            done(None)

        work.get_future().add_done_callback(self._keeper.wrap(finish))

    @staticmethod
    def _scatter(fused: torch.Tensor, views: List[torch.Tensor], pieces) -> None:
        for view, part, piece in zip(views, torch.split(fused, [v.numel() for v in views]), pieces):
            view.copy_(part)
            piece.task.writes += 1

    def _launch_cuda(self, op: Operation, views: List[torch.Tensor], done: Done) -> None:
        stream = torch.cuda.current_stream(views[0].device)
        for piece in op.pieces:
            ready = piece.task.context
            if ready is not None:
                stream.wait_event(ready)
        tensor = views[0] if len(views) == 1 else torch.cat(views)
        work = dist.all_reduce(tensor, group=self._lanes[op.lane], async_op=True)
        self._keeper.watch(tensor)
        work.wait()  # the current stream waits for the collective; the host does not
        if len(views) > 1:
            self._scatter(tensor, views, op.pieces)
        finished = torch.cuda.Event()
        finished.record(stream)
        # Keep the fused buffer alive until the copy back has run.
        finished.fused_buffer = tensor  # type: ignore[attr-defined]
        with self._cuda_lock:
            waiter = self._cuda.get(op.lane)
            if waiter is None:
                waiter = self._cuda[op.lane] = _CudaCompletion(op.lane)
        waiter.put(finished, done)

    def close(self) -> None:
        """Join the CUDA waiter threads (none on CPU); call it after the scheduler stopped."""
        with self._cuda_lock:
            waiters, self._cuda = list(self._cuda.values()), {}
        for waiter in waiters:
            waiter.close()
