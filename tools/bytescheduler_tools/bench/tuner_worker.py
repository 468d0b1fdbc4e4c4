"""One rank of ``bytescheduler tuner-check``: a grid of partition x credit, then the tuner from a plan.

Run by :mod:`bytescheduler_tools.bench.tuner_check`, never by hand. Two phases, on every rank
alike (torch.distributed, gloo):

1. **Grid**: one ScheduledOptimizer on the scheduled path (``adaptive=False``); each round
   switches to every setting in turn (``Scheduler.reconfigure``, as the tuner switches),
   lets the pieces of the old setting drain for ``--settle`` steps, then times a block of
   ``--iters`` steps (a barrier starts it, ``synchronize()`` ends it). Rounds alternate the
   order, so slow drift of the machine affects every setting alike.
2. **Tuner**: a fresh ScheduledOptimizer with ``plan=FILE, auto_tune=True`` (the tuner starts
   at the plan's setting) for ``--tuner-steps`` steps; rank 0 records, per step, its time,
   the setting in force and the tuner's best so far.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .models import build


def _optimizer(args: argparse.Namespace, **options):
    import bytescheduler.pytorch as bsp

    torch.manual_seed(0)
    model, make_batch = build(args.model)
    optimizer = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), **options)
    inputs, targets = make_batch(args.batch_size, torch.Generator().manual_seed(args.rank))

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    return optimizer, step


def run_grid(args: argparse.Namespace, settings: List[Tuple[int, int]]) -> Dict[str, List[float]]:
    """Seconds per step of every setting, one block per round."""
    first_partition, first_credit = settings[0]
    optimizer, step = _optimizer(args, partition_bytes=first_partition, credit_bytes=first_credit, adaptive=False)
    scheduler = optimizer._bytescheduler.scheduler
    times: Dict[str, List[float]] = {f"{p}:{c}": [] for p, c in settings}
    try:
        for _ in range(args.warmup):
            step()
        for round_index in range(args.rounds):
            order = settings if round_index % 2 == 0 else settings[::-1]
            for partition, credit in order:
                scheduler.reconfigure(partition, credit)
                for _ in range(args.settle):
                    step()
                optimizer.synchronize()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.iters):
                    step()
                optimizer.synchronize()
                times[f"{partition}:{credit}"].append((time.perf_counter() - start) / args.iters)
            if args.rank == 0:
                print(f"PROGRESS {round_index + 1}/{args.rounds + 1}", flush=True)
    finally:
        optimizer.close()
    return times


def run_tuner(args: argparse.Namespace) -> dict:
    """The tuner from the plan: per step (rank 0) its seconds, the setting in force, the best so far."""
    optimizer, step = _optimizer(args, plan=args.plan, auto_tune=True)
    tuner = optimizer._bytescheduler.scheduler.tuner  # rank 0 only (the others replay its pieces)
    steps = []
    try:
        dist.barrier()
        last = time.perf_counter()
        for _ in range(args.tuner_steps):
            in_force = None if tuner is None else list(tuner.trial)
            step()
            now = time.perf_counter()
            best = None if tuner is None or tuner.best is None else [tuner.best.partition_bytes,
                                                                     tuner.best.credit_bytes]
            steps.append({"seconds": now - last, "setting": in_force, "best_so_far": best})
            last = now
        optimizer.synchronize()
    finally:
        optimizer.close()
    if tuner is None:
        return {"steps": steps}
    return {"steps": steps, "done": tuner.done, "result": tuner.result,
            "trials": [[t.partition_bytes, t.credit_bytes, t.seconds_per_step] for t in tuner.history]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--settings", nargs="+", required=True, help="PARTITION:CREDIT in bytes")
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--settle", type=int, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--tuner-steps", type=int, required=True)
    parser.add_argument("--output", required=True, help="result file; {rank} is replaced by the rank")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=600))
    try:
        settings = [tuple(int(x) for x in setting.split(":")) for setting in args.settings]
        grid = run_grid(args, settings)
        tuner = run_tuner(args)
        if args.rank == 0:
            print(f"PROGRESS {args.rounds + 1}/{args.rounds + 1}", flush=True)
        with open(args.output.replace("{rank}", str(args.rank)), "w") as handle:
            json.dump({"rank": args.rank, "grid": grid, "tuner": tuner}, handle)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
