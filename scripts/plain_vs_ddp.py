"""ScheduledOptimizer's plain path against DDP, phase by phase, on 2 local gloo ranks.

    python scripts/plain_vs_ddp.py [--model vgg-small] [--batch-size 16] [--rounds 15] [--iters 10] [--start-plain]

Each rank is pinned to a CPU of its own (CPUs 0 and 1) and uses one compute thread, as in
``bytescheduler bench``. Both systems live in each process and run in alternating blocks
of ``--iters`` iterations. ScheduledOptimizer first runs the mode switch's own trials until
it has chosen (or, with ``--start-plain``, starts on the plain path); its hold is made long
enough that no re-trial falls in the measured blocks. Rank 0 prints the median wall time and
training-thread CPU time of forward, backward, step and the whole iteration, per system, and
the path ScheduledOptimizer ran.
"""

import argparse
import collections
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

PHASES = ("forward", "backward", "step", "iteration")


def _iteration(model, optimizer, inputs, targets):
    """One iteration; the (wall, thread CPU) time at each phase boundary."""
    marks = [(time.perf_counter(), time.thread_time())]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(inputs), targets)
    marks.append((time.perf_counter(), time.thread_time()))
    loss.backward()
    marks.append((time.perf_counter(), time.thread_time()))
    optimizer.step()
    marks.append((time.perf_counter(), time.thread_time()))
    spans = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    return spans + [(marks[-1][0] - marks[0][0], marks[-1][1] - marks[0][1])]


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import bytescheduler.pytorch as bsp
    from bytescheduler_tools.bench.models import build
    from bytescheduler.core import modes
    from torch.nn.parallel import DistributedDataParallel

    os.environ["BYTESCHEDULER_MODE_SWITCH"] = modes.ModeSwitchParams(hold=1_000_000).text()  # no re-trial inside the measured blocks
    systems = {}
    for name in ("DDP", "ScheduledOptimizer"):
        torch.manual_seed(0)
        model, make_batch = build(args.model)
        inputs, targets = make_batch(args.batch_size, torch.Generator().manual_seed(rank))
        if name == "DDP":
            model = DistributedDataParallel(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        else:
            optimizer = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                               adaptive=True, start_plain=args.start_plain)
        systems[name] = (model, optimizer, inputs, targets)
    scheduled = systems["ScheduledOptimizer"]
    switch = scheduled[1]._bytescheduler._switch
    while switch.chooser.choices == 0:
        _iteration(*scheduled)
    scheduled[1].synchronize()
    times = collections.defaultdict(list)
    for round_index in range(args.rounds + 1):  # the first round warms up
        for name, system in systems.items():
            dist.barrier()
            for _ in range(args.iters):
                spans = _iteration(*system)
                if round_index:
                    for phase, (wall, cpu) in zip(PHASES, spans):
                        times[name, phase, "wall"].append(wall)
                        times[name, phase, "cpu"].append(cpu)
    if rank == 0:
        history = "".join(mode[0] for mode in switch.chooser.history)
        print(f"{args.model}, batch {args.batch_size}: ScheduledOptimizer's steps before the measurement "
              f"{history[:-args.iters * (args.rounds + 1)] or '-'}, measured on the "
              f"{'plain' if scheduled[1]._bytescheduler.plain else 'scheduled'} path")
        print("| system | phase | wall ms (median) | training-thread CPU ms (median) |")
        print("|---|---|---|---|")
        for name in systems:
            for phase in PHASES:
                wall = 1000 * statistics.median(times[name, phase, "wall"])
                cpu = 1000 * statistics.median(times[name, phase, "cpu"])
                print(f"| {name} | {phase} | {wall:.1f} | {cpu:.1f} |")
    scheduled[1].close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg-small")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--start-plain", action="store_true", help="hold the plain path from the first step")
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(port, args), nprocs=2)


if __name__ == "__main__":
    main()
