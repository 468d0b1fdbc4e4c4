"""Horovod + ScheduledOptimizer on its plain path against ``hvd.DistributedOptimizer``, one job.

    horovodrun -np 2 -H localhost:2 python scripts/hvd_plain_path.py [--model cnn-small]
        [--blocks 30] [--iters 10] [--profile 100]

Both systems, and a second ``hvd.DistributedOptimizer`` as an A/A control, live in each
process (their all-reduces named apart) and run in turns, blocks of ``--iters`` steps, each
rank pinned to CPU ``rank`` with one compute thread, as in ``bytescheduler bench``.
ScheduledOptimizer starts on Horovod's own path (``start_plain``) and its first re-trial comes
after far more steps than are run, so every step compared is on that path: what the mode
switch's plain mode costs over Horovod itself. Rank 0 prints the median step of each system
and the ratios; ``--profile N`` then prints a cProfile of N more steps of the scheduled one
(the training thread's Python).
"""

import argparse
import cProfile
import os
import pstats
import statistics
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import bytescheduler.pytorch.horovod as bsh
from bytescheduler_tools.bench.models import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn-small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    # Pinned before Horovod starts its background thread, which then shares the rank's CPU
    # (threads inherit the affinity of the thread that starts them), as in the bench.
    os.sched_setaffinity(0, {int(os.environ.get("HOROVOD_RANK", "0")) % os.cpu_count()})
    hvd.init()
    torch.set_num_threads(1)

    def make(scheduled: bool, prefix: str):
        torch.manual_seed(0)
        model, batch = build(args.model)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        named = [(prefix + name, param) for name, param in model.named_parameters()]
        optimizer = hvd.DistributedOptimizer(sgd, named_parameters=named)
        if scheduled:
            optimizer = bsh.ScheduledOptimizer(model, optimizer, 10**6, adaptive=True, start_plain=True)
        return model, optimizer, batch

    systems = {"hvd.DistributedOptimizer": make(False, "a."), "ScheduledOptimizer (plain path)": make(True, "b."),
               "hvd.DistributedOptimizer again": make(False, "c.")}  # the A/A control
    inputs, targets = next(iter(systems.values()))[2](args.batch_size, torch.Generator().manual_seed(hvd.rank()))

    def step(model, optimizer) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    for model, optimizer, _ in systems.values():
        for _ in range(20):  # warm-up
            step(model, optimizer)
    times = {name: [] for name in systems}
    for block in range(args.blocks):
        names = list(systems)
        order = names[block % 3:] + names[:block % 3]  # each first in turn
        for name in order:
            model, optimizer, _ = systems[name]
            hvd.allreduce(torch.zeros(1), name=f"barrier.{block}.{name}")
            began = time.perf_counter()
            for _ in range(args.iters):
                step(model, optimizer)
            times[name].append((time.perf_counter() - began) / args.iters)
    medians = {name: statistics.median(values) for name, values in times.items()}
    if hvd.rank() == 0:
        for name, median in medians.items():
            print(f"{name}: {median * 1e3:.2f} ms per step (median of {args.blocks} blocks)")
        baseline, scheduled, again = medians.values()
        print(f"speed-up of the plain path: {baseline / scheduled:.3f}x (the A/A control: {baseline / again:.3f}x)",
              flush=True)
    if args.profile:
        model, optimizer, _ = systems["ScheduledOptimizer (plain path)"]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.profile):
            step(model, optimizer)
        profile.disable()
        if hvd.rank() == 0:
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    systems["ScheduledOptimizer (plain path)"][1].close()  # before Horovod shuts down
    hvd.shutdown()


if __name__ == "__main__":
    main()
