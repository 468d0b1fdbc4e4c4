"""Run a function on N real processes joined by torch.distributed gloo on 127.0.0.1.

Every run has a deadline: when it passes, or when any rank fails, the processes this
helper started are killed and the test fails with each rank's traceback.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn, rank, world_size, port, args, results, env):
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
        # DDP models of ``fn`` live on in reference cycles and hold the process group: collect
        # them first, or gloo's threads may outlive the interpreter and abort the exit.
        gc.collect()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


class RanksFailed(AssertionError):
    pass


# How long a failed run waits for the other ranks' reports: a rank's error is often the
# echo of another's (gloo's "Connection closed by peer" when the other rank died first).
_OTHERS_WAIT = 5.0


def _failure_report(first: str, done: List[int], results: Any, processes: List[Any]) -> str:
    """``first`` (what failed first; ``done``: the ranks it or a result accounts for), then what
    the other ranks send within ``_OTHERS_WAIT``, and which died without a word (a crash in
    native code)."""
    report = [first]
    silent = {r for r in range(len(processes)) if r not in done}
    end = time.monotonic() + _OTHERS_WAIT
    exited = False  # all silent ranks had exited at the last empty read: one more read, then stop
    while silent and time.monotonic() < end:
        try:
            other, status, value = results.get(timeout=min(0.2, max(0.01, end - time.monotonic())))
        except queue.Empty:
            if exited:
                break
            exited = all(processes[r].exitcode is not None for r in silent)
            continue
        silent.discard(other)
        if status != "ok":
            report.append(f"rank {other} failed too:\n{value}")
    for other in sorted(silent):
        code = processes[other].exitcode
        if code not in (None, 0):
            report.append(f"rank {other} exited with code {code} without a report")
    return "\n".join(report)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    deadline: float = 120.0,
    env: Dict[str, str] = None,
    expect_failures: bool = False,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    With ``expect_failures=True`` a rank's traceback is returned as its result (a string
    starting with ``"ERROR\\n"``) instead of failing the run.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_child, args=(fn, rank, world_size, port, args, results, env or {}), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcome: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    end = time.monotonic() + deadline
    try:
        while len(outcome) + len(errors) < world_size:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise RanksFailed(
                    f"deadline of {deadline} s passed; finished ranks: {sorted(outcome)}, "
                    f"failed: {errors}"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(processes)
                        if p.exitcode not in (None, 0) and r not in outcome and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {processes[r].exitcode} without a result"
                if dead and not expect_failures:
                    died = "; ".join(f"rank {r}: {errors[r]}" for r in dead)
                    raise RanksFailed(_failure_report(f"rank(s) died: {died}", [*outcome, *dead], results, processes))
                continue
            if status == "ok":
                outcome[rank] = value
            elif expect_failures:
                errors[rank] = value
            else:
                raise RanksFailed(_failure_report(f"rank {rank} failed:\n{value}", [*outcome, rank],
                                                  results, processes))
        for rank, process in enumerate(processes):
            process.join(timeout=max(1.0, end - time.monotonic()))
            if process.is_alive():
                raise RanksFailed(f"rank process {process.pid} did not exit after returning")
            if rank in outcome and process.exitcode != 0:  # e.g. aborted while shutting down
                raise RanksFailed(f"rank {rank} returned, then exited with code {process.exitcode}")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    merged = dict(outcome)
    merged.update({rank: "ERROR\n" + text for rank, text in errors.items()})
    return [merged[rank] for rank in range(world_size)]
