"""Ranks as local processes (spawned), for the commands that run 2 ranks on 127.0.0.1.

Each rank runs ``target(rank, world_size, port, *args, results)`` and puts
``(rank, payload, failure)`` on ``results``: its payload, or None and a traceback.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any, Callable, Dict, Optional, Sequence


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_local_ranks(target: Callable, args: Sequence[Any], world_size: int, timeout: float,
                    label: str) -> Optional[Dict[int, Any]]:
    """Every rank's payload; None (said on stderr, under ``label``) if a rank failed or
    ``timeout`` seconds passed. Kills what it started and is still running."""
    import multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=target, args=(rank, world_size, port, *args, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    payloads: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(payloads) < world_size:
            try:
                rank, payload, failure = results.get(timeout=1.0)
            except Exception:  # queue.Empty
                if time.monotonic() > deadline:
                    print(f"{label}: no result within {timeout} s", file=sys.stderr)
                    return None
                if any(p.exitcode not in (None, 0) for p in processes):
                    print(f"{label}: a rank failed", file=sys.stderr)
                    return None
                continue
            if failure is not None:
                print(f"{label}: rank {rank} failed:\n{failure}", file=sys.stderr)
                return None
            payloads[rank] = payload
        for process in processes:
            process.join(30)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    return payloads
