"""How fast gloo moves one iteration's gradients as pieces, next to one all-reduce.

Two ranks on the bench's testbed (network namespaces, ``tbf`` at the given rate; needs root,
else loopback) all-reduce 116 MiB (VGG-like's gradients) as one tensor and as pieces with a
bounded number in flight, as the scheduler sends them, in alternating rounds; then the same
pieces while another thread of the rank keeps its one core busy, with torch kernels (the GIL
released) or with pure Python (the GIL held). Rank 0 prints the median of each variant.

    python scripts/link_pace.py --bandwidth 1gbit --rounds 5

A measurement for docs/benchmarks.md ("Where VGG-like's gain stops"), not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

MIB = 1 << 20
GRADIENT_BYTES = 116 * MIB


def _hog(kind: str, stop: threading.Event) -> None:
    if kind == "torch":
        import torch

        a = torch.randn(256, 256)
        while not stop.is_set():
            a @ a
    else:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i


def rank_main(rounds: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    flat = torch.ones(GRADIENT_BYTES // 4)

    def pieces(piece_mib: int, in_flight: int) -> None:
        step = piece_mib * MIB // 4
        works = []
        for start in range(0, flat.numel(), step):
            if len(works) >= in_flight:
                works.pop(0).wait()
            works.append(dist.all_reduce(flat[start:start + step], async_op=True))
        for work in works:
            work.wait()

    variants = {
        "one 116 MiB all-reduce": (lambda: dist.all_reduce(flat), None),
        "4 MiB pieces, 4 in flight": (lambda: pieces(4, 4), None),
        "4 MiB pieces, 2 in flight": (lambda: pieces(4, 2), None),
        "8 MiB pieces, 2 in flight": (lambda: pieces(8, 2), None),
        "4 MiB pieces, 4 in flight, core busy with torch": (lambda: pieces(4, 4), "torch"),
        "4 MiB pieces, 4 in flight, core busy with Python": (lambda: pieces(4, 4), "python"),
    }
    times = {name: [] for name in variants}
    pieces(4, 4)  # warm up
    for _ in range(rounds):
        for name, (run, hog) in variants.items():
            stop = threading.Event()
            thread = threading.Thread(target=_hog, args=(hog, stop)) if hog else None
            if thread:
                thread.start()
                time.sleep(0.02)
            dist.barrier()
            began = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - began)
            stop.set()
            if thread:
                thread.join()
    if rank == 0:
        for name, values in times.items():
            print(f"{name:<50} median {statistics.median(values):.4f} s  (min {min(values):.4f}, "
                  f"max {max(values):.4f})")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from bytescheduler_tools.bench.testbed import make_testbed, pin_cores

    with make_testbed(2, args.bandwidth) as net:
        net.cores = pin_cores(2)
        print(net.description, flush=True)
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), MASTER_ADDR=net.master_addr, MASTER_PORT="29533", **net.env(rank),
                       LINK_PACE_RANK="1")
            procs.append(subprocess.Popen(net.wrap(rank, [sys.executable, __file__, "--rounds", str(args.rounds)]),
                                          env=env))
        try:
            codes = [proc.wait(timeout=600 + 60 * args.rounds) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return max(codes)


if __name__ == "__main__":
    if os.environ.get("LINK_PACE_RANK"):
        parser = argparse.ArgumentParser()
        parser.add_argument("--rounds", type=int, default=5)
        rank_main(parser.parse_known_args()[0].rounds)
        raise SystemExit(0)
    raise SystemExit(main())
