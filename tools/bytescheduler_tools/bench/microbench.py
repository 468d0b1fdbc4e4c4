"""Micro-benchmark of the core: pieces scheduled per second with a backend that does nothing.

It measures what the scheduler itself costs per piece (queueing, credit, merging, thread
hand-offs, completion), which is overhead added to every communication operation.

    bytescheduler microbench --pieces 200000
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Dict, List

from bytescheduler.core import Scheduler, Task


class _NoOpBackend:
    """Completes each operation at once, from the dispatcher thread."""

    def launch(self, op, done) -> None:
        done(None)


class _ThreadedNoOpBackend:
    """Completes operations from another thread, as a real backend's callbacks do."""

    def __init__(self) -> None:
        import queue

        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            done = self._queue.get()
            if done is None:
                return
            done(None)

    def launch(self, op, done) -> None:
        self._queue.put(done)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


SCENARIOS = {
    # name: (task elements, partition bytes, merge, credit bytes)
    "partition": (1 << 20, 16 * 1024, False, 1 << 30),  # 4 MiB tasks -> 256 pieces each
    "one-piece-tasks": (256, 1 << 20, False, 1 << 30),  # every task is one operation
    "merge": (256, 64 * 1024, True, 1 << 30),  # 1 KiB tasks fused 64 to an operation
    "tight-credit": (1 << 20, 16 * 1024, False, 64 * 1024),  # 4 ops in flight at most
}


def run_scenario(name: str, pieces: int, threaded: bool) -> Dict[str, float]:
    numel, partition_bytes, merge, credit_bytes = SCENARIOS[name]
    per_task = max(1, numel * 4 // partition_bytes) if not merge else 1
    tasks = max(1, pieces // per_task)
    backend = _ThreadedNoOpBackend() if threaded else _NoOpBackend()
    scheduler = Scheduler(backend, partition_bytes=partition_bytes, credit_bytes=credit_bytes, merge=merge,
                          fast_lane_bytes=0)
    try:
        started = time.perf_counter()
        futures = [
            scheduler.submit(Task(key=i, numel=numel, itemsize=4, priority=i % 97, payload=None, fuse_key=0))
            for i in range(tasks)
        ]
        for future in futures:
            future.result(timeout=600)
        elapsed = time.perf_counter() - started
        stats = scheduler.stats
    finally:
        scheduler.stop()
        if threaded:
            backend.close()
    return {
        "tasks": tasks,
        "pieces": stats["pieces"],
        "operations": stats["operations"],
        "seconds": elapsed,
        "us_per_piece": elapsed / stats["pieces"] * 1e6,
        "pieces_per_second": stats["pieces"] / elapsed,
    }


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(prog="bytescheduler microbench", description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", type=int, default=100_000, help="pieces per run (default 100000)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per scenario; the median is shown")
    args = parser.parse_args(argv)
    print(f"{'scenario':<16} {'completion':<10} {'pieces':>8} {'ops':>8} {'us/piece':>9} {'pieces/s':>10}")
    for name in SCENARIOS:
        for threaded in (False, True):
            runs = [run_scenario(name, args.pieces, threaded) for _ in range(args.repeats)]
            median = statistics.median(r["us_per_piece"] for r in runs)
            last = runs[-1]
            print(
                f"{name:<16} {'thread' if threaded else 'inline':<10} {last['pieces']:>8} "
                f"{last['operations']:>8} {median:>9.2f} {1e6 / median:>10.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
