"""Timeline: a Chrome trace (JSON array format) of what the scheduler did, one file per rank.

Open it in https://ui.perfetto.dev or chrome://tracing. Each rank is one process; tasks
(ready to done), pieces waiting in the queue, and operations in flight per lane are
async spans, so overlapping spans stay readable.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

if TYPE_CHECKING:
    from .task import Operation, Task

_FLUSH_EVERY = 4096


def timeline_path(path: str, rank: int) -> str:
    """The file of ``rank`` for a configured ``path``.

    ``{rank}`` in the path is replaced; otherwise ``.rank<N>`` goes before the suffix.

    >>> timeline_path("/tmp/trace.json", 1)
    '/tmp/trace.rank1.json'
    >>> timeline_path("/tmp/t-{rank}.json", 0)
    '/tmp/t-0.json'
    """
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def _open(configured: str, path: str, mode: str) -> Any:
    try:
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        return open(path, mode, encoding="utf-8")
    except OSError as error:
        raise ValueError(f"timeline={configured!r} (BYTESCHEDULER_TIMELINE): cannot write {path} "
                         f"({error.strerror or error}); give a path in a writable folder") from error


def check_writable(path: Optional[str], rank: int) -> None:
    """Raise a clear ``ValueError`` now if ``rank``'s timeline file could not be written later
    (so that an adapter reports it before the ranks start working together)."""
    if path:
        _open(path, timeline_path(path, rank), "a").close()


class Timeline:
    """Collects trace events and writes them as valid JSON on :meth:`close`.

    Times passed in are ``time.perf_counter()`` seconds; they are written as wall-clock
    microseconds so that traces of different ranks line up. Set ``recording = False`` to
    skip the steps you do not want traced (recording costs a little per operation).
    """

    recording = True

    def __init__(self, path: str, rank: int) -> None:
        self.path = timeline_path(path, rank)
        self.rank = rank
        self._file = _open(path, self.path, "w")
        self._file.write("[\n")
        self._first = True
        self._events: List[Dict[str, Any]] = []
        self._lock = threading.Lock()
        self._offset = time.time() - time.perf_counter()
        self._next_id = 0
        self._emit({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})

    def _us(self, seconds: float) -> float:
        return round((seconds + self._offset) * 1e6, 3)

    def _emit(self, event: Dict[str, Any]) -> None:
        self._events.append(event)

    def span(self, category: str, name: str, start: float, end: float, args: Optional[dict] = None) -> None:
        """Record one async span from ``start`` to ``end`` (perf_counter seconds)."""
        with self._lock:
            if self._file is None:
                return
            self._next_id += 1
            span_id = self._next_id
            begin = {"name": name, "cat": category, "ph": "b", "id": span_id, "pid": self.rank,
                     "tid": 0, "ts": self._us(start)}
            if args:
                begin["args"] = args
            self._emit(begin)
            self._emit({"name": name, "cat": category, "ph": "e", "id": span_id, "pid": self.rank,
                        "tid": 0, "ts": self._us(end)})
            if len(self._events) >= _FLUSH_EVERY:
                self._flush()

    def operation(self, op: "Operation", finished: "Sequence[Task]", end: float) -> None:
        """Record one finished operation: its pieces' time in the queue, its time in flight on
        its lane, and the tasks it finished (ready to done)."""
        names = "+".join(p.task.name for p in op.pieces)
        for piece in op.pieces:
            self.span("queue", piece.task.name, piece.queued_time, op.launch_time,
                      {"start": piece.start, "stop": piece.stop})
        self.span(f"lane{op.lane}", names, op.launch_time, end, {"bytes": op.nbytes, "pieces": len(op.pieces)})
        for task in finished:
            self.span("task", task.name, task.ready_time, end,
                      {"key": task.key, "generation": task.generation, "bytes": task.nbytes,
                       "priority": task.priority})

    def _flush(self) -> None:
        if not self._events or self._file is None:
            return
        text = ",\n".join(json.dumps(event, separators=(",", ":")) for event in self._events)
        if not self._first:
            text = ",\n" + text
        self._first = False
        self._file.write(text)
        self._events.clear()

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            self._flush()
            self._file.write("\n]\n")
            self._file.close()
            self._file = None
