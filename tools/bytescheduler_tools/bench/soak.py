"""``bytescheduler soak``: long runs of every adapter, checking that what each rank holds stays flat.

    bytescheduler soak --steps 10000                       # every adapter, 10,000 steps each
    bytescheduler soak --adapters optimizer hook --steps 2000 --sample-every 50 --out soak-results

For each adapter (``optimizer``: ScheduledOptimizer over torch.distributed; ``hook``: DDP with
the scheduled hook; ``horovod``: ScheduledOptimizer over Horovod; ``mxnet``: ScheduledKVStore
with ``dist_sync``) a 2-rank job on 127.0.0.1 (:mod:`~bytescheduler_tools.bench.jobs`) trains a small
model for ``--steps`` steps with the adapter's defaults, the mode switch included, and every
``--sample-every`` steps each rank samples its RSS, threads, open file descriptors and open
sockets, and (glibc) malloc's bytes in use and kept free (:mod:`~bytescheduler_tools.bench.rank_loop`).
Nothing in the caller's environment is changed for the job but what launching needs (``BYTESCHEDULER_*`` settings pass through);
``--schedule-only`` turns the mode switch off, so that every step takes the scheduled path
(with it on, small models run mostly on the framework's own path, trying the schedule again
every 200 to 3,200 steps).

**Flat** (:func:`judge`): from the first sample at or after ``--warmup`` steps (default a fifth
of the run, at most 500) to the end, on every rank, RSS never exceeds that first sample by
more than ``--rss-mib`` (default 8 MiB), and the numbers of threads, descriptors and sockets
never change. The job must also finish, every rank exiting 0, within its deadline.

Writes ``soak.json`` (every sample of every rank and the verdicts) into ``--out`` (and a
failed job's logs and reports into ``--out``/logs) and prints a markdown table; exits 1 when an adapter is not flat, or its job left a process running or a
port listening.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from typing import Dict, List, Optional

from .jobs import ADAPTERS, REFERENCES, WORLD, Job, default_mxnet_python, sigterm_unwinds, wait_until_closed
from .rank_loop import read_report

DEFAULT_RSS_MIB = 8.0
COUNTS = ("threads", "fds", "sockets")


def default_warmup(steps: int) -> int:
    """A fifth of the run, at most 500 steps: the mode switch's first trials and the
    allocator's first growth are over by then."""
    return min(500, steps // 5)


def _slope_mib_per_1000(samples: List[dict]) -> float:
    """Least-squares RSS growth in MiB per 1,000 steps."""
    if len(samples) < 2:
        return 0.0
    steps = [s["step"] for s in samples]
    rss = [s["rss_kib"] / 1024 for s in samples]
    mean_step, mean_rss = sum(steps) / len(steps), sum(rss) / len(rss)
    spread = sum((x - mean_step) ** 2 for x in steps)
    if not spread:
        return 0.0
    return 1000 * sum((x - mean_step) * (y - mean_rss) for x, y in zip(steps, rss)) / spread


def judge(samples: List[dict], warmup: int, rss_mib: float = DEFAULT_RSS_MIB) -> dict:
    """One rank's verdict from its ``sample`` events (see the module docstring for "flat").

    >>> flat = [{"step": s, "rss_kib": 500_000, "threads": 9, "fds": 40, "sockets": 12} for s in range(0, 1000, 100)]
    >>> judge(flat, warmup=200)["flat"]
    True
    >>> leaking = [dict(s, rss_kib=s["rss_kib"] + 20 * s["step"]) for s in flat]   # 20 KiB a step
    >>> judge(leaking, warmup=200)["problems"]
    ['RSS grew 13.7 MiB after warm-up (allowed 8 MiB)']
    """
    after = [s for s in samples if s["step"] >= warmup]
    if not after:
        return {"flat": False, "problems": [f"no sample at or after step {warmup}"], "samples_after_warmup": 0}
    first, last = after[0], after[-1]
    growth = (max(s["rss_kib"] for s in after) - first["rss_kib"]) / 1024
    verdict = {
        "samples_after_warmup": len(after),
        "first": first, "last": last,
        "rss_first_mib": first["rss_kib"] / 1024, "rss_last_mib": last["rss_kib"] / 1024,
        "rss_max_growth_mib": growth,
        "rss_mib_per_1000_steps": _slope_mib_per_1000(after),
    }
    if "malloc_in_use_kib" in first:  # glibc: tells a leak (in use) from memory kept free
        verdict["malloc_mib"] = {key: (first[f"malloc_{key}_kib"] / 1024, last[f"malloc_{key}_kib"] / 1024)
                                 for key in ("in_use", "free")}
        verdict["malloc_arenas"] = (first["malloc_arenas"], last["malloc_arenas"])
    problems = []
    if growth > rss_mib:
        problems.append(f"RSS grew {growth:.1f} MiB after warm-up (allowed {rss_mib:g} MiB)")
    for count in COUNTS:
        values = [s[count] for s in after]
        verdict[count] = {"first": values[0], "last": values[-1], "min": min(values), "max": max(values)}
        if min(values) != max(values):
            problems.append(f"{count} changed after warm-up: {values[0]} -> {values[-1]} "
                            f"(between {min(values)} and {max(values)})")
    verdict.update(flat=not problems, problems=problems)
    return verdict


def soak_adapter(adapter: str, args: argparse.Namespace, work_dir: str) -> dict:
    """Run one adapter's soak job; its result (per-rank samples and verdicts)."""
    options = ["--steps", str(args.steps), "--sample-every", str(args.sample_every), "--model", args.model,
               "--batch-size", str(args.batch_size)]
    if args.timeout is not None:
        options += ["--timeout", str(args.timeout)]
    python = args.mxnet_python if adapter == "mxnet" else sys.executable
    deadline = args.deadline if args.deadline else 120 + args.steps * 0.25
    env = {"BYTESCHEDULER_ADAPTIVE": "0"} if args.schedule_only else {}
    job = Job(adapter, options, os.path.join(work_dir, adapter), deadline, python=python, env=env)
    finished = False
    try:
        job.start()
        finished = job.wait()
    finally:
        helpers = {process.name for process in job.processes if process.helper}  # they serve until stopped
        left = [name for name in job.kill() if name not in helpers]
    ports_left = sorted(wait_until_closed(job.ports))
    result = {"adapter": adapter, "finished": finished, "exit_codes": job.exit_codes(), "left_running": left,
              "ports": sorted(job.ports), "ports_left": ports_left, "seconds": time.time() - job.started, "ranks": {}}
    problems = [] if finished else [f"not finished within the deadline of {deadline:g} s"]
    failed = {name: code for name, code in job.exit_codes().items() if code != 0 and name not in helpers}
    if failed and finished:
        problems.append(f"exit codes {failed}")
    if left and finished:
        problems.append(f"still running after the job: {', '.join(left)}")
    if ports_left:
        problems.append(f"ports still listening after the job: {ports_left}")
    for rank in range(WORLD):
        events = read_report(job.report_path(rank))
        samples = [e for e in events if e["event"] == "sample"]
        done = next((e for e in events if e["event"] == "done"), None)
        error = next((e for e in events if e["event"] == "error"), None)
        closed = next((e for e in events if e["event"] == "closed"), None)
        verdict = judge(samples, args.warmup, args.rss_mib)
        if error is not None:
            problems.append(f"rank {rank} raised {error['type']}: {error['message'][:300]}")
        problems += [f"rank {rank}: {problem}" for problem in verdict["problems"]]
        result["ranks"][rank] = {
            "samples": samples, "closed": closed, "verdict": verdict,
            "seconds_per_step": None if done is None else done["seconds"] / args.steps,
            "modes": None if done is None else done["modes"],
        }
    result["problems"] = problems
    result["flat"] = not problems
    result["log_dir"] = job.keep_logs(os.path.join(os.path.abspath(args.out), "logs")) if problems else None
    return result


def table(results: List[dict]) -> str:
    """The markdown table: per adapter and rank, first sample after warm-up vs last, max growth."""
    lines = ["| adapter | rank | steps | s/step | RSS MiB first -> last | max RSS growth MiB | MiB/1k steps "
             "| malloc in use MiB | malloc free MiB | threads | fds | sockets | steps per path | flat |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for rank, data in sorted(result["ranks"].items()):
            verdict = data["verdict"]
            if "first" not in verdict:
                empty = "| " * 11
                lines.append(f"| {result['adapter']} | {rank} | {empty}no ({'; '.join(result['problems'])}) |")
                continue
            per_step = data["seconds_per_step"]
            counts = [f"{verdict[c]['first']} -> {verdict[c]['last']}" + ("" if verdict[c]["min"] == verdict[c]["max"]
                      else f" ({verdict[c]['min']}-{verdict[c]['max']})") for c in COUNTS]
            malloc = verdict.get("malloc_mib", {})
            in_use, free = (f"{malloc[key][0]:.1f} -> {malloc[key][1]:.1f}" if key in malloc else ""
                            for key in ("in_use", "free"))
            lines.append(
                f"| {result['adapter']} | {rank} | {verdict['last']['step']} | "
                f"{'' if per_step is None else f'{per_step:.4f}'} | "
                f"{verdict['rss_first_mib']:.1f} -> {verdict['rss_last_mib']:.1f} | {verdict['rss_max_growth_mib']:.1f} | "
                f"{verdict['rss_mib_per_1000_steps']:+.2f} | {in_use} | {free} | {' | '.join(counts)} | "
                f"{_modes(data['modes'])} | "
                f"{'yes' if result['flat'] else 'no'} |")
    return "\n".join(lines)


def _modes(modes: Optional[Dict[str, int]]) -> str:
    return "" if not modes else ", ".join(f"{name} {count}" for name, count in sorted(modes.items()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bytescheduler soak", description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", nargs="+", choices=ADAPTERS + REFERENCES, default=list(ADAPTERS),
                        help="default: every adapter; ddp (plain DDP, no bytescheduler) runs as a reference when named")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--sample-every", type=int, default=None, help="default: steps / 100, at least 10")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps before the flatness is judged (default: a fifth of the run, at most 500)")
    parser.add_argument("--rss-mib", type=float, default=DEFAULT_RSS_MIB,
                        help=f"RSS growth allowed after warm-up, MiB (default {DEFAULT_RSS_MIB:g})")
    parser.add_argument("--model", default="tiny", help="a model of bench/models.py (and mxnet_models.py)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=None, help="the adapters' timeout= (default: theirs)")
    parser.add_argument("--schedule-only", action="store_true",
                        help="turn the mode switch off (BYTESCHEDULER_ADAPTIVE=0): every step on the scheduled path")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds per adapter's job before it is killed (default: 120 + 0.25 per step)")
    parser.add_argument("--mxnet-python", default=default_mxnet_python(),
                        help="interpreter with MXNet and bytescheduler (default: $BYTESCHEDULER_MXNET_PYTHON, "
                        "else this one if it has MXNet, else this checkout's .venv-mxnet/bin/python)")
    parser.add_argument("--out", default="soak-results", help="folder for soak.json")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sample_every is None:
        args.sample_every = max(10, args.steps // 100)
    if args.warmup is None:
        args.warmup = default_warmup(args.steps)
    if "mxnet" in args.adapters and not args.mxnet_python:
        parser.error("the mxnet adapter needs --mxnet-python (or $BYTESCHEDULER_MXNET_PYTHON, or .venv-mxnet)")
    os.makedirs(args.out, exist_ok=True)
    results = []
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="bytescheduler-soak-") as work_dir:
        for adapter in args.adapters:
            print(f"soak: {adapter}, {args.steps} steps ...", file=sys.stderr, flush=True)
            result = soak_adapter(adapter, args, work_dir)
            results.append(result)
            for problem in result["problems"]:
                print(f"  {adapter}: {problem}", file=sys.stderr)
            if result["log_dir"]:
                print(f"  {adapter}: logs and reports in {result['log_dir']}", file=sys.stderr)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    with open(os.path.join(args.out, "soak.json"), "w") as handle:
        json.dump({"settings": settings, "cpu_seconds": cpu, "results": results}, handle, indent=1)
    print(table(results))
    print(f"flat: RSS growth <= {args.rss_mib:g} MiB and threads, fds, sockets constant from step "
          f"{args.warmup} on; {cpu:.0f} CPU-seconds; {os.path.abspath(args.out)}/soak.json", file=sys.stderr)
    return 0 if all(result["flat"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
