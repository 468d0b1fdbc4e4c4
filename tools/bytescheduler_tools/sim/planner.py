"""``bytescheduler plan``: the partition and credit to run with, or not to schedule at all.

    bytescheduler plan --model vgg16-v100 --ranks 16 --bandwidth 25gbit --json plan.json
    bytescheduler plan --profile my-model.json --ranks 64 --bandwidth 10gbit --system ddp-hook

For one profile and one cluster, the simulator predicts the framework's own path (DDP's
buckets, the mode switch's plain path) and the scheduled system at every setting of a grid
of partition x credit; the plan is the fastest setting, or "don't schedule" when no setting
beats the framework's own path by ``--min-gain``. The grid is the one the online tuner
walks (:class:`~bytescheduler.core.tuning.AutoTuner`: partitions in powers of two, credit
a power-of-two multiple of the partition), so a tuner that starts from the plan
(``auto_tune=True, plan=FILE``) climbs from there. ``--json FILE`` writes the plan
(:mod:`bytescheduler.core.plan`), which every adapter reads: ``plan=FILE`` or
``BYTESCHEDULER_PLAN=FILE``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from bytescheduler.core.config import SchedulerConfig, format_size, parse_size
from bytescheduler.core.plan import Plan
from .engine import Result, network_defaults, simulate
from .inputs import add_network_arguments, add_profile_arguments, network_from, profile_from
from .network import Network
from .profile import Profile

MiB = 1024**2
# The framework's own system of each scheduled system: what "don't schedule" runs (the
# bench's names of the parameter-server pair too).
FRAMEWORK_PATH: Dict[str, str] = {"scheduled": "ddp", "ddp-hook": "ddp", "hvd-scheduled": "hvd",
                                  "ps-scheduled": "ps", "mxnet-scheduled": "mxnet"}
PARTITIONS = tuple(MiB << k for k in range(8)) + (MiB // 4, MiB // 2)  # 256 KiB .. 128 MiB
CREDIT_MULTIPLES = (1, 2, 4, 8, 16)
# Settings this close to the fastest count as equally fast; of those the plan takes the one
# with the fewest operations (each costs CPU, which the simulator does not count).
TIE = 0.005


@dataclass(frozen=True)
class Candidate:
    """One simulated setting (partition and credit 0: the framework's own path)."""

    partition_bytes: int
    credit_bytes: int
    result: Result

    @property
    def seconds(self) -> float:
        return self.result.seconds


def search(profile: Profile, network: Network, ranks: int, system: str = "scheduled",
           partitions: Sequence[int] = PARTITIONS, credit_multiples: Sequence[int] = CREDIT_MULTIPLES,
           min_gain: float = 0.03, iterations: int = 8, config: Optional[SchedulerConfig] = None) -> Plan:
    """The plan for ``profile`` on ``ranks`` ranks of ``network``: the grid's fastest setting of
    ``system``, scheduled only when it beats the framework's own path by more than ``min_gain``.

    ``config``: the settings besides partition and credit (default: the adapter's).

    >>> from bytescheduler_tools.sim.profile import Layer, Tensor
    >>> one = Profile("one", (Layer("x", 0.05, (Tensor(2_000_000, 0.2),)),), backward_s=0.2, step_s=0.01)
    >>> plan = search(one, Network(bandwidth=1e8), 2, partitions=[MiB], credit_multiples=[1])
    >>> plan.schedule  # one tensor: nothing to reorder, nothing to overlap
    False
    """
    if system not in FRAMEWORK_PATH:
        raise ValueError(f"cannot plan {system!r}: use one of {', '.join(FRAMEWORK_PATH)}")
    base = config if config is not None else network_defaults(system, network, ranks)
    framework = Candidate(0, 0, simulate(profile, network, ranks, FRAMEWORK_PATH[system], iterations=iterations))
    grid = []
    for partition in partitions:
        for multiple in credit_multiples:
            settings = base.with_options(partition_bytes=partition, credit_bytes=partition * multiple)
            grid.append(Candidate(partition, partition * multiple,
                                  simulate(profile, network, ranks, system, settings, iterations)))
    default = Candidate(base.partition_bytes, base.credit_bytes, simulate(profile, network, ranks, system, base,
                                                                          iterations))
    fastest = min(c.seconds for c in grid)
    ties = [c for c in grid if c.seconds <= fastest * (1 + TIE)]
    best = min(ties, key=lambda c: (c.result.operations, c.credit_bytes, c.partition_bytes))
    schedule = best.seconds < framework.seconds * (1 - min_gain)
    details = {
        "model": profile.model, "system": system, "framework_path": FRAMEWORK_PATH[system], "ranks": ranks,
        "bandwidth_bytes_per_s": network.bandwidth, "latency_s": network.latency, "op_seconds": network.op_seconds,
        "algorithm": network.algorithm, "min_gain": min_gain,
        "framework_seconds": framework.seconds, "best_seconds": best.seconds,
        "default": _row(default), "predicted_speedup": framework.seconds / best.seconds if best.seconds else 1.0,
        "grid": [_row(c) for c in sorted(grid, key=lambda c: c.seconds)],
    }
    return Plan(schedule, best.partition_bytes, best.credit_bytes, details)


def _row(candidate: Candidate) -> dict:
    return {"partition_bytes": candidate.partition_bytes, "credit_bytes": candidate.credit_bytes,
            "seconds": candidate.seconds, "operations": candidate.result.operations,
            "link_busy": candidate.result.link_busy}



def describe(plan: Plan, rows: int = 5) -> str:
    """The plan as a short markdown table (the fastest settings, the plan's, the adapter's
    default and the framework's own path) and a recommendation."""
    details = plan.details
    framework = details["framework_seconds"]
    chosen = (plan.partition_bytes, plan.credit_bytes)
    shown = details["grid"][:rows]
    shown += [row for row in details["grid"][rows:] if (row["partition_bytes"], row["credit_bytes"]) == chosen]
    lines = [f"Plan for {details['model']} on {details['ranks']} ranks at "
             f"{details['bandwidth_bytes_per_s'] * 8 / 1e9:g} Gbit/s ({details['system']}):", "",
             "| partition | credit | predicted s/iter | speedup vs the framework's own path | operations/iter |",
             "|---|---|---|---|---|",
             f"| the framework's own path ({details['framework_path']}) | | {framework:.3f} | 1.00x | |"]
    for label, row in [("", row) for row in shown] + [(" (the adapter's default)", details["default"])]:
        if (row["partition_bytes"], row["credit_bytes"]) == chosen and not label:
            label = " (the plan)"
        lines.append(f"| {format_size(row['partition_bytes'])} | {format_size(row['credit_bytes'])}{label} | "
                     f"{row['seconds']:.3f} | {framework / row['seconds']:.2f}x | {row['operations']:.0f} |")
    best = details["best_seconds"]
    setting = f"partition {format_size(plan.partition_bytes)}, credit {format_size(plan.credit_bytes)}"
    if plan.schedule:
        lines += ["", f"Recommendation: schedule with {setting}: predicted {best:.3f} s/iter, "
                  f"{framework / best:.2f}x the framework's own path ({framework:.3f} s/iter)."]
    else:
        lines += ["", f"Recommendation: don't schedule: the best setting ({setting}, {best:.3f} s/iter) gains less "
                  f"than {100 * details['min_gain']:g}% over the framework's own path ({framework:.3f} s/iter)."]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bytescheduler plan", description=__doc__.splitlines()[0])
    add_profile_arguments(parser)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--bandwidth", required=True, help="each rank's link, e.g. 1gbit, 25gbit")
    add_network_arguments(parser)
    parser.add_argument("--system", choices=sorted(FRAMEWORK_PATH), default="scheduled",
                        help="the adapter to plan for (default scheduled: ScheduledOptimizer)")
    parser.add_argument("--partitions", nargs="+", help="partition sizes to try (default 256KiB to 128MiB, x2)")
    parser.add_argument("--credit-multiples", nargs="+", type=int, default=list(CREDIT_MULTIPLES),
                        help="credits to try, as multiples of the partition (default 1 2 4 8 16)")
    parser.add_argument("--min-gain", type=float, default=0.03,
                        help="schedule only when predicted faster than the framework's own path by more than "
                        "this fraction (default 0.03: the simulator leaves out the scheduler's CPU)")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--json", help="write the plan to this file (for plan=FILE / BYTESCHEDULER_PLAN=FILE)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    profile = profile_from(args)
    network = network_from(args, args.bandwidth)
    partitions = [parse_size(size, "--partitions") for size in args.partitions] if args.partitions else PARTITIONS
    plan = search(profile, network, args.ranks, args.system, partitions, args.credit_multiples, args.min_gain,
                  args.iterations)
    print(describe(plan))
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(plan.to_json())
        print(f"\nWritten to {args.json}: pass plan=\"{args.json}\" to the adapter, or set "
              f"BYTESCHEDULER_PLAN={args.json}.")
    return 0
