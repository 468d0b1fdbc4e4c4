"""``bytescheduler sweep``: predicted speedups over ranks, link rates, partitions and credits; a plot.

    bytescheduler sweep --model vgg16-v100 --ranks 2-1024 --bandwidth 10gbit 25gbit 100gbit \\
        --partition 4MiB 16MiB 64MiB --credit 16MiB 64MiB 256MiB --plot speedup.png --json sweep.json
    bytescheduler sweep --model transformer-v100 --ranks 8 16 32 64 --bandwidth 10gbit 25gbit 100gbit \\
        --partition 4MiB 16MiB 64MiB --credit 64MiB 256MiB --compare-paper

For every (ranks, rate) the framework's own path (DDP) is simulated once and the scheduled
system at every partition x credit; the table shows the best setting of each (ranks, rate),
``--json`` writes every prediction, ``--plot`` draws the best speedup against ranks, one
line per rate. ``--ranks`` takes numbers and ranges ``A-B`` (the powers of two from A to B).
With ``--compare-paper`` (the paper's models only) each row also shows the speedup the
ByteScheduler paper reports for that GPU count and, since its baseline ran far below its
link rate, our prediction at the rate that makes our DDP as slow as its baseline.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from bytescheduler.core.config import SchedulerConfig, format_size, parse_size
from .engine import default_config, simulate
from .network import Network, parse_rate
from .paper import MODELS as PAPER_MODELS, REPORTED, REPORTED_SETUP, reported_seconds, reported_speedup
from .planner import FRAMEWORK_PATH
from .profile import Profile
from .inputs import add_network_arguments, add_profile_arguments, profile_from

MiB = 1024**2


@dataclass(frozen=True)
class Prediction:
    """One simulated setting on one cluster, against the framework's own path there."""

    ranks: int
    bandwidth: str
    partition_bytes: int
    credit_bytes: int
    framework_seconds: float
    seconds: float

    @property
    def speedup(self) -> float:
        return self.framework_seconds / self.seconds if self.seconds else 1.0


def parse_ranks(values: Sequence[str]) -> List[int]:
    """Rank counts from numbers and ranges ``A-B`` (every power of two from A to B).

    >>> parse_ranks(["2-16", "24"])
    [2, 4, 8, 16, 24]
    """
    ranks = set()
    for value in values:
        low, _, high = value.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"--ranks {value!r} is not a number or a range: use e.g. 16 or 2-1024") from None
        if first < 1 or last < first:
            raise ValueError(f"--ranks {value!r}: use numbers of at least 1, the smaller first (2-1024)")
        count = first
        while count <= last:
            ranks.add(count)
            count = count * 2 if high else last + 1
    return sorted(ranks)


class Sweep:
    """Predictions for one profile and system over clusters and settings.

    >>> from bytescheduler_tools.sim.profile import Layer, Tensor
    >>> one = Profile("one", (Layer("x", 0.05, (Tensor(2_000_000, 0.2),)),), backward_s=0.2, step_s=0.01)
    >>> rows = Sweep(one).run([2, 4], ["1gbit"], [MiB], [4 * MiB])
    >>> [(row.ranks, round(row.speedup, 2)) for row in rows]
    [(2, 1.0), (4, 1.0)]
    """

    def __init__(self, profile: Profile, system: str = "scheduled", latency: float = 50e-6, op_seconds: float = 0.0,
                 algorithm: str = "ring", iterations: int = 8, servers: int = 0) -> None:
        if system not in FRAMEWORK_PATH:
            raise ValueError(f"cannot sweep {system!r}: use one of {', '.join(FRAMEWORK_PATH)}")
        self.profile, self.system, self.iterations = profile, system, iterations
        self.latency, self.op_seconds, self.algorithm = latency, op_seconds, algorithm
        self.servers = servers

    def network(self, bandwidth: float) -> Network:
        return Network(bandwidth, latency=self.latency, op_seconds=self.op_seconds, algorithm=self.algorithm,
                       servers=self.servers)

    def defaults(self, ranks: int, bandwidth: Optional[float] = None) -> SchedulerConfig:
        """The adapter's own settings on ``ranks`` ranks (the parameter server's partition
        follows the number of servers and, given, the link's ``bandwidth``)."""
        return default_config(self.system, servers=self.servers or ranks, bandwidth=bandwidth)

    def settings(self, ranks: int, partitions: Sequence[Optional[int]],
                 credits: Sequence[Optional[int]], bandwidth: Optional[float] = None) -> List[Tuple[int, int]]:
        """Every (partition, credit) to simulate on ``ranks`` (at ``bandwidth``); None stands
        for the adapter's default."""
        own = self.defaults(ranks, bandwidth)
        return [(own.partition_bytes if p is None else p, own.credit_bytes if c is None else c)
                for p in partitions for c in credits]

    def framework_seconds(self, ranks: int, bandwidth: float) -> float:
        return simulate(self.profile, self.network(bandwidth), ranks, FRAMEWORK_PATH[self.system],
                        iterations=self.iterations).seconds

    def seconds(self, ranks: int, bandwidth: float, partition_bytes: int, credit_bytes: int) -> float:
        config = self.defaults(ranks, bandwidth).with_options(partition_bytes=partition_bytes, credit_bytes=credit_bytes)
        return simulate(self.profile, self.network(bandwidth), ranks, self.system, config, self.iterations).seconds

    def run(self, ranks: Sequence[int], rates: Sequence[str], partitions: Sequence[Optional[int]] = (None,),
            credits: Sequence[Optional[int]] = (None,)) -> List[Prediction]:
        """Every (ranks, rate, partition, credit), the framework's own path once per (ranks, rate);
        a partition or credit of None is the adapter's default on that cluster."""
        rows = []
        for count in ranks:
            for rate in rates:
                bandwidth = parse_rate(rate)
                framework = self.framework_seconds(count, bandwidth)
                rows += [Prediction(count, rate, partition, credit, framework,
                                    self.seconds(count, bandwidth, partition, credit))
                         for partition, credit in self.settings(count, partitions, credits, bandwidth)]
        return rows


def best_per_cluster(rows: Sequence[Prediction]) -> Dict[Tuple[int, str], Prediction]:
    """The fastest setting of each (ranks, rate)."""
    best: Dict[Tuple[int, str], Prediction] = {}
    for row in rows:
        key = (row.ranks, row.bandwidth)
        if key not in best or row.seconds < best[key].seconds:
            best[key] = row
    return best


def effective_rate(sweep: Sweep, ranks: int, target_seconds: float, low: float = 1e6, high: float = 1e12) -> float:
    """The link rate (bytes/s) at which the framework's own path takes ``target_seconds``
    (bisection on a log scale); NaN when no rate in [low, high] is that slow, or when the
    target is within 2% of the compute alone (the baseline waited for nothing: any fast
    link fits)."""
    if target_seconds < 1.02 * sweep.profile.compute_s:
        return float("nan")
    if not (sweep.framework_seconds(ranks, high) <= target_seconds <= sweep.framework_seconds(ranks, low)):
        return float("nan")
    for _ in range(30):
        middle = math.sqrt(low * high)
        if sweep.framework_seconds(ranks, middle) > target_seconds:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)



def _table(best: Dict[Tuple[int, str], Prediction], paper: Optional[Dict[int, Tuple[float, float, float]]],
           framework: str = "ddp") -> str:
    header = f"| ranks | bandwidth | {framework} s/iter | best setting | scheduled s/iter | predicted speedup |"
    rule = "|---|---|---|---|---|---|"
    if paper is not None:
        header += " paper's speedup | rate of the paper's baseline | predicted speedup there |"
        rule += "---|---|---|"
    lines = [header, rule]
    for (ranks, rate), row in best.items():
        line = (f"| {ranks} | {rate} | {row.framework_seconds:.3f} | {format_size(row.partition_bytes)}, "
                f"{format_size(row.credit_bytes)} | {row.seconds:.3f} | {row.speedup:.2f}x |")
        if paper is not None:
            reported, rate_there, speedup_there = paper.get(ranks, (math.nan,) * 3)
            line += f" {_times(reported)} | {_gbit(rate_there)} | {_times(speedup_there)} |"
        lines.append(line)
    return "\n".join(lines)


def _times(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.2f}x"


def _gbit(rate: float) -> str:
    return "—" if math.isnan(rate) else f"{rate * 8 / 1e9:.1f} Gbit/s"


def _finite(value: float) -> Optional[float]:
    """``value``, or None for NaN (JSON has no NaN)."""
    return None if math.isnan(value) else value


def compare_with_paper(sweep: Sweep, name: str, partitions: Sequence[Optional[int]] = (None,),
                       credits: Sequence[Optional[int]] = (None,)) -> Dict[int, Tuple[float, float, float]]:
    """Per GPU count the paper reports: its speedup, the rate at which our DDP is as slow as
    its baseline, and our best predicted speedup at that rate."""
    out = {}
    for gpus in REPORTED.get(name, {}):
        rate = effective_rate(sweep, gpus, reported_seconds(name, gpus))
        speedup = math.nan
        if not math.isnan(rate):
            framework = sweep.framework_seconds(gpus, rate)
            fastest = min(sweep.seconds(gpus, rate, p, c) for p, c in sweep.settings(gpus, partitions, credits, rate))
            speedup = framework / fastest
        out[gpus] = (reported_speedup(name, gpus), rate, speedup)
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bytescheduler sweep", description=__doc__.splitlines()[0])
    add_profile_arguments(parser)
    parser.add_argument("--ranks", nargs="+", default=["2-1024"], help="numbers and ranges A-B (powers of two)")
    parser.add_argument("--bandwidth", nargs="+", default=["1gbit", "10gbit", "25gbit", "100gbit"])
    parser.add_argument("--partition", nargs="+", help="partition sizes (default: the adapter's)")
    parser.add_argument("--credit", nargs="+", help="credit sizes (default: the adapter's)")
    parser.add_argument("--system", choices=sorted(FRAMEWORK_PATH), default="scheduled")
    add_network_arguments(parser)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--compare-paper", action="store_true",
                        help=f"add the ByteScheduler paper's speedups ({REPORTED_SETUP}; paper models only)")
    parser.add_argument("--plot", help="write a PNG of the best predicted speedup against ranks, a line per rate")
    parser.add_argument("--json", help="write every prediction to this JSON file")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        ranks = parse_ranks(args.ranks)
        rates = [(rate, parse_rate(rate)) for rate in args.bandwidth]
    except ValueError as error:
        parser.error(str(error))
    if args.compare_paper and args.model not in PAPER_MODELS:
        parser.error(f"--compare-paper needs one of the paper's models: --model {' | '.join(PAPER_MODELS)}")
    # None: the adapter's default on each cluster (the parameter server's follows the servers)
    partitions = [parse_size(s, "--partition") for s in args.partition] if args.partition else [None]
    credits = [parse_size(s, "--credit") for s in args.credit] if args.credit else [None]
    profile = profile_from(args)
    sweep = Sweep(profile, args.system, args.latency_us * 1e-6, args.op_us * 1e-6, args.algorithm, args.iterations,
                  args.servers)
    rows = sweep.run(ranks, [rate for rate, _ in rates], partitions, credits)
    best = best_per_cluster(rows)
    paper = compare_with_paper(sweep, args.model, partitions, credits) if args.compare_paper else None
    print(f"Profile {profile.model}, {args.system} against {FRAMEWORK_PATH[args.system]}, "
          f"{len(partitions) * len(credits)} setting(s) per cluster; the best of each:\n")
    print(_table(best, paper, FRAMEWORK_PATH[args.system]))
    if args.compare_paper:
        print(f"\nThe paper: {REPORTED_SETUP} (bytescheduler/docs/mxnet_ps_rdma_*_sync.png, branch bytescheduler "
              "of github.com/bytedance/byteps).")
    if args.plot:
        from ..bench.charts import speedup_chart

        by_rate = {rate: [(row.ranks, row.speedup) for (_, name), row in best.items() if name == rate]
                   for rate, _ in rates}
        shown = ranks if len(ranks) <= 5 else [ranks[i * (len(ranks) - 1) // 4] for i in range(5)]
        by_ranks = {count: [(bandwidth * 8 / 1e9, best[(count, rate)].speedup) for rate, bandwidth in rates]
                    for count in shown}
        speedup_chart(by_rate, by_ranks, f"{profile.model}: predicted speedup of {args.system} over "
                      f"{FRAMEWORK_PATH[args.system]}, best of {len(partitions) * len(credits)} settings "
                      f"({sweep.algorithm}, {args.latency_us:g} us per step)", args.plot)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"profile": profile.model, "system": args.system, "framework_path": FRAMEWORK_PATH[args.system],
                       "latency_s": sweep.latency, "op_seconds": sweep.op_seconds, "algorithm": sweep.algorithm,
                       "predictions": [dict(asdict(row), speedup=row.speedup) for row in rows],
                       "paper": {str(gpus): {"reported_speedup": _finite(value[0]),
                                             "baseline_rate_bytes_per_s": _finite(value[1]),
                                             "predicted_speedup_there": _finite(value[2])}
                                 for gpus, value in paper.items()}
                       if paper is not None else None}, handle, indent=1)
    return 0
