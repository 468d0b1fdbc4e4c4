"""``bytescheduler tuner-check``: does the online tuner, started from a plan, reach the best grid setting?

    bytescheduler tuner-check --model vgg --bandwidth 1gbit --json tuner-check.json
    bytescheduler tuner-check --model tiny --bandwidth none --partitions 64KiB 256KiB --credit-multiples 1 4 \\
        --rounds 1 --iters 2 --tuner-steps 20          # a quick correctness run

On the 2-rank testbed of ``bytescheduler bench`` (a shaped link, or loopback), one job:

1. a plan (``--plan FILE``, or made here: the model profiled on this machine and planned
   with the simulator for 2 ranks at ``--plan-bandwidth``, by default the testbed's rate);
2. the grid: ScheduledOptimizer on the scheduled path at every partition x credit
   (``--partitions``, default 1 MiB to 64 MiB; ``--credit-multiples`` of the partition,
   default 1 2 4) and at the plan's setting, in alternating timed blocks; its fastest
   setting is the reference;
3. the tuner (``auto_tune=True, plan=FILE``) for ``--tuner-steps`` steps: the setting it
   runs and the best it has measured, step by step.

The verdict: the first step by which the tuner's best setting so far is within
``--within`` (5%) of the grid's fastest, by the grid's own times; the issue asks for at most
``--by-step`` (20). Times on a loaded machine are not a measurement: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from bytescheduler.core.config import format_size, parse_size
from bytescheduler.core.plan import Plan, read_plan
from .models import MODELS
from bytescheduler.launcher import free_port
from .runner import JobFailed, Process, run_processes, show_logs
from .testbed import make_testbed, pin_cores

WORLD = 2
MiB = 1024**2
# The testbed's rates a plan made here assumes for loopback (gloo over 127.0.0.1 measured ~1.3 GB/s).
LOOPBACK_RATE = "10gbit"



def make_plan(model: str, batch_size: int, rate: str, path: str) -> None:
    """Profile ``model`` here and write the simulator's plan for 2 ranks at ``rate`` to ``path``."""
    from ..sim.network import Network, parse_rate
    from ..sim.planner import search
    from ..sim.profile import measure

    plan = search(measure(model, batch_size), Network(parse_rate(rate)), WORLD)
    with open(path, "w") as handle:
        handle.write(plan.to_json())


def grid_settings(plan: Tuple[int, int], partitions: Sequence[int], multiples: Sequence[int]) -> List[Tuple[int, int]]:
    """The grid: every partition x every credit multiple of it, and the plan's setting.

    >>> grid_settings((3 * MiB, 3 * MiB), [MiB, 2 * MiB], [1, 4])[-1]
    (3145728, 3145728)
    """
    settings = [(size, size * multiple) for size in partitions for multiple in multiples]
    return settings if plan in settings else settings + [plan]


def verdict(grid: Dict[Tuple[int, int], float], steps: List[dict], within: float) -> dict:
    """When the tuner's best setting so far first came within ``within`` of the grid's fastest.

    >>> grid = {(1, 1): 1.0, (2, 2): 0.8}
    >>> steps = [{"best_so_far": None}, {"best_so_far": [1, 1]}, {"best_so_far": [2, 2]}]
    >>> verdict(grid, steps, 0.05)["reached_at_step"]
    3
    """
    fastest = min(grid, key=grid.get)
    reached = None
    for index, step in enumerate(steps, start=1):
        best = step.get("best_so_far")
        if best is not None and tuple(best) in grid and grid[tuple(best)] <= grid[fastest] * (1 + within):
            reached = index
            break
    return {"grid_fastest": list(fastest), "grid_fastest_seconds": grid[fastest], "within": within,
            "reached_at_step": reached}


def _report(plan: Plan, grid: Dict[Tuple[int, int], float], tuner: dict, result: dict, by_step: int) -> str:
    fastest = grid[tuple(result["grid_fastest"])]
    lines = [f"Plan: {'schedule' if plan.schedule else 'do not schedule'}, partition {format_size(plan.partition_bytes)}, "
             f"credit {format_size(plan.credit_bytes)}.", "",
             "| partition | credit | measured s/step (median of rounds) | vs the fastest |", "|---|---|---|---|"]
    for (partition, credit), seconds in sorted(grid.items(), key=lambda item: item[1]):
        mark = " (the plan's)" if (partition, credit) == (plan.partition_bytes, plan.credit_bytes) else ""
        lines.append(f"| {format_size(partition)} | {format_size(credit)}{mark} | {seconds:.4f} | {seconds / fastest:.3f} |")
    lines += ["", "| tuner trial | partition | credit | tuner's median s/step | grid's s/step |", "|---|---|---|---|---|"]
    for index, (partition, credit, seconds) in enumerate(tuner.get("trials", []), start=1):
        known = grid.get((partition, credit))
        lines.append(f"| {index} | {format_size(partition)} | {format_size(credit)} | {seconds:.4f} | "
                     f"{'' if known is None else f'{known:.4f}'} |")
    reached = result["reached_at_step"]
    within = 100 * result["within"]
    if reached is None:
        lines += ["", f"The tuner's best setting did not come within {within:g}% of the grid's fastest in "
                  f"{len(tuner['steps'])} steps."]
    else:
        ok = "within" if reached <= by_step else "NOT within"
        lines += ["", f"The tuner's best setting was within {within:g}% of the grid's fastest "
                  f"({format_size(result['grid_fastest'][0])}, {format_size(result['grid_fastest'][1])}: {fastest:.4f} s/step) "
                  f"from step {reached}: {ok} the {by_step} steps asked for."]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bytescheduler tuner-check", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg", choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--bandwidth", default="1gbit", help="the testbed's link, e.g. 1gbit, or none (loopback)")
    parser.add_argument("--plan", help="the plan to start the tuner from (default: made here with the simulator)")
    parser.add_argument("--plan-bandwidth", help=f"the rate to plan for (default: --bandwidth; {LOOPBACK_RATE} "
                        "for loopback)")
    parser.add_argument("--partitions", nargs="+", default=[f"{1 << k}MiB" for k in range(7)],
                        help="the grid's partition sizes (default 1MiB to 64MiB, x2)")
    parser.add_argument("--credit-multiples", nargs="+", type=int, default=[1, 2, 4],
                        help="the grid's credits, as multiples of the partition (default 1 2 4)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--settle", type=int, default=2, help="steps after a switch before timing")
    parser.add_argument("--iters", type=int, default=5, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=3, help="timed blocks per setting")
    parser.add_argument("--tuner-steps", type=int, default=40)
    parser.add_argument("--within", type=float, default=0.05)
    parser.add_argument("--by-step", type=int, default=20)
    parser.add_argument("--deadline", type=float, default=3600, help="seconds the job may take")
    parser.add_argument("--json", help="write the grid, the tuner's steps and the verdict here")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bytescheduler-tuner-check-") as work_dir:
        plan_path = args.plan
        if plan_path is None:
            rate = args.plan_bandwidth or (LOOPBACK_RATE if args.bandwidth == "none" else args.bandwidth)
            plan_path = os.path.join(work_dir, "plan.json")
            make_plan(args.model, args.batch_size, rate, plan_path)
        plan = read_plan(plan_path)
        partitions = [parse_size(size, "--partitions") for size in args.partitions]
        settings = grid_settings((plan.partition_bytes, plan.credit_bytes), partitions, args.credit_multiples)
        try:
            with make_testbed(WORLD, args.bandwidth) as testbed:
                testbed.cores = pin_cores(WORLD)
                print(f"bytescheduler tuner-check: {args.model}, {len(settings)} settings, "
                      f"network: {testbed.description}", file=sys.stderr)
                port = free_port()
                processes = []
                for rank in range(WORLD):
                    command = [sys.executable, "-m", "bytescheduler_tools.bench.tuner_worker", "--rank", str(rank),
                               "--world-size", str(WORLD), "--master", testbed.master_addr, "--port", str(port),
                               "--model", args.model, "--batch-size", str(args.batch_size), "--plan", plan_path,
                               "--settings", *[f"{p}:{c}" for p, c in settings], "--warmup", str(args.warmup),
                               "--settle", str(args.settle), "--iters", str(args.iters), "--rounds", str(args.rounds),
                               "--tuner-steps", str(args.tuner_steps),
                               "--output", os.path.join(work_dir, "rank{rank}.json")]
                    env = dict(os.environ, **testbed.env(rank), BYTESCHEDULER_TIMELINE="", BYTESCHEDULER_PLAN="")
                    processes.append(Process(f"rank{rank}", testbed.wrap(rank, command), env))
                run_processes("tuner", processes, work_dir, time.monotonic() + args.deadline)
        except JobFailed as error:
            show_logs(error.log_dir)
            print(f"tuner-check: {error}", file=sys.stderr)
            return 1
        with open(os.path.join(work_dir, "rank0.json")) as handle:
            measured = json.load(handle)
    grid = {tuple(int(x) for x in key.split(":")): statistics.median(times) for key, times in measured["grid"].items()}
    result = verdict(grid, measured["tuner"]["steps"], args.within)
    print(_report(plan, grid, measured["tuner"], result, args.by_step))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"plan": json.loads(plan.to_json()), "grid": [[p, c, s] for (p, c), s in grid.items()],
                       "grid_blocks": measured["grid"], "tuner": measured["tuner"], "verdict": result,
                       "testbed": args.bandwidth, "model": args.model}, handle, indent=1)
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0
