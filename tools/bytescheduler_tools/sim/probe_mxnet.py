"""One worker of ``bytescheduler calibrate`` over MXNet's parameter server (ps-lite, ``dist_sync``).

Run by :mod:`bytescheduler_tools.sim.calibrate` with the MXNet interpreter (started as
``bytescheduler bench`` starts its MXNet jobs: a scheduler, and a server and a worker per
rank, each rank's processes pinned to its CPU), never by hand. Imports no torch. The same
phases as :mod:`bytescheduler_tools.sim.probe_torch` (memcpy, idle, small, large), with
push-pulls (``pushpull``, as gluon's Trainer calls it) of a one-element key and of a
``--megabytes`` key (which MXNet splits over both servers); besides this process's CPU and
the kernel's interrupt work it records the CPU of the server on this rank's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, List, Optional

import mxnet as mx
import numpy as np

from ..bench.common import pinned_cpu
from ..bench.procstats import marked_pids
from bytescheduler.launcher import run_worker
from .usage import Usage, repeat

_COPY_BYTES = 64 * 2**20


def memcpy_rate(repeats: int = 8) -> float:
    """Bytes per second one thread copies (best of ``repeats`` copies of 64 MiB)."""
    source = np.ones(_COPY_BYTES // 4, dtype=np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return _COPY_BYTES / best


def _servers_on(cpu: Optional[int]) -> List[int]:
    """The pids of this job's servers pinned to ``cpu`` (the job's processes share its root port)."""
    if cpu is None:
        return []
    found = []
    for pid in marked_pids("DMLC_PS_ROOT_PORT", os.environ.get("DMLC_PS_ROOT_PORT", "")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                server = b"DMLC_ROLE=server" in handle.read().split(b"\0")
            if server and os.sched_getaffinity(pid) == {cpu}:
                found.append(pid)
        except OSError:
            continue
    return found


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-ops", type=int, default=300)
    parser.add_argument("--large-ops", type=int, default=6)
    parser.add_argument("--megabytes", type=int, default=32)
    parser.add_argument("--output", required=True, help="JSON per rank; {rank} is replaced")
    args = parser.parse_args(argv)
    kv = mx.kv.create("dist_sync")
    cpu = pinned_cpu()
    usage = Usage(_servers_on(cpu))

    small = mx.nd.zeros((1,))
    large = mx.nd.zeros((args.megabytes * 2**20 // 4,))
    kv.init(0, small)
    kv.init(1, large)

    def pushpull(key: int, array: mx.nd.NDArray) -> Callable[[], None]:
        def run() -> None:
            kv.pushpull(key, array, out=array)
            array.wait_to_read()
        return run

    for _ in range(20):
        pushpull(0, small)()
    pushpull(1, large)()
    report = {"backend": "ps-lite", "rank": kv.rank, "world": kv.num_workers, "pinned": cpu is not None,
              "servers_seen": len(usage.peers), "memcpy_bytes_per_s": memcpy_rate()}
    kv._barrier()
    report["idle"] = repeat(usage, lambda: time.sleep(1.0), 1)
    kv._barrier()
    report["small"] = repeat(usage, pushpull(0, small), args.small_ops)
    kv._barrier()
    report["large"] = repeat(usage, pushpull(1, large), args.large_ops, sample_cpu=True, bytes=large.size * 4)
    kv._barrier()
    with open(args.output.replace("{rank}", str(kv.rank)), "w") as out:
        json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    run_worker(main)
