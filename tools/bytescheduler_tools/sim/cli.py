"""``bytescheduler simulate``: predicted seconds per iteration of each system, any ranks and rate.

    bytescheduler simulate --model vgg --ranks 2 --bandwidth 1gbit --systems ddp scheduled
    bytescheduler simulate --model vgg --ranks 2 8 64 --bandwidth 10gbit 25gbit --json out.json
    bytescheduler simulate --trace bench-results/traces/scheduled.rank0.json --calibration calibration.json
    bytescheduler simulate --model vgg --bandwidth 1gbit --systems hvd hvd-scheduled --gantt vgg.png

The model's profile is measured on this machine first (a few iterations, one thread), built
in (``--model vgg16-v100``, ``resnet50-v100``, ``transformer-v100``: :mod:`.paper`), read
with ``--profile FILE`` (written by ``--save-profile FILE``), or taken from a recorded run's
Chrome trace (``--trace``). Several ranks or rates sweep every combination. With
``--calibration`` (``bytescheduler calibrate``) communication costs CPU on each rank's core.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List, Optional

from bytescheduler.core.config import parse_size
from .calibration import Calibration
from .engine import SYSTEM_NAMES, SYSTEMS, Result, canonical, network_defaults, simulate
from .inputs import add_network_arguments, add_profile_arguments, network_from, profile_from

# What each scheduled system's speedup is against: its framework's own system.
BASELINES = {"ddp-hook": "ddp", "scheduled": "ddp", "hvd-scheduled": "hvd", "ps-scheduled": "ps"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bytescheduler simulate", description=__doc__.splitlines()[0])
    add_profile_arguments(parser)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--bandwidth", nargs="+", default=["1gbit"],
                        help="each rank's link, e.g. 1gbit 25gbit, or none (loopback: no link limit)")
    add_network_arguments(parser)
    parser.add_argument("--systems", nargs="+", choices=SYSTEM_NAMES, default=list(SYSTEMS),
                        help="default: all (the bench's names mxnet, mxnet-scheduled are ps, ps-scheduled)")
    parser.add_argument("--partition", help="partition size for the scheduled systems (default: the adapter's)")
    parser.add_argument("--credit", help="credit size for the scheduled systems (default: the adapter's)")
    parser.add_argument("--calibration", help="costs measured by bytescheduler calibrate (default: no CPU model)")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--json", help="also write the predictions to this JSON file")
    parser.add_argument("--gantt", metavar="FILE",
                        help="draw the simulated iterations of each system (first ranks and rate) to PNG "
                             "(FILE, or FILE with -<system> before its suffix for several systems)")
    return parser


def gantt_path(path: str, system: str, several: bool) -> str:
    """``path`` for one system, or with ``-system`` before its suffix when several are drawn.

    >>> gantt_path("out/vgg.png", "ddp", True), gantt_path("out/vgg.png", "ddp", False)
    ('out/vgg-ddp.png', 'out/vgg.png')
    """
    if not several:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{system}{ext or '.png'}"


def _speedup(results: Dict[str, Result], system: str, seconds: float) -> str:
    baseline = results.get(BASELINES.get(canonical(system), ""))
    if baseline is None:
        baseline = next((r for name, r in results.items() if canonical(name) == BASELINES.get(canonical(system))), None)
    return f"{baseline.seconds / seconds:.2f}x" if baseline and seconds else ""


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        calibration = Calibration.load(args.calibration) if args.calibration else None
        profile = profile_from(args)
        networks = [(rate, network_from(args, rate)) for rate in args.bandwidth]
    except ValueError as error:
        parser.error(str(error))
    options = {}
    if args.partition:
        options["partition_bytes"] = parse_size(args.partition, "--partition")
    if args.credit:
        options["credit_bytes"] = parse_size(args.credit, "--credit")
    rows, lines = [], []
    lines.append(f"Profile {profile.model}: {len(profile.layers)} layers, {profile.gradient_bytes / 2**20:.1f} MiB of "
                 f"gradients, forward {profile.forward_s * 1e3:.1f} ms, backward {profile.backward_s * 1e3:.1f} ms, "
                 f"step {profile.step_s * 1e3:.1f} ms; "
                 + (f"CPU model from {args.calibration} ({calibration.cores} core(s) per rank)." if calibration
                    else "no CPU model (no --calibration)."))
    lines += ["", "| ranks | bandwidth | system | predicted s/iter | speedup | framework path s/iter | "
                  "the mode switch runs | link busy | core busy | operations/iter |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    drawn = False
    for ranks in args.ranks:
        for rate, network in networks:
            results: Dict[str, Result] = {}
            for system in args.systems:
                config = network_defaults(system, network, ranks)
                if options and canonical(system) in BASELINES:
                    config = config.with_options(**options)
                try:
                    results[system] = simulate(profile, network, ranks, system, config, args.iterations,
                                               calibration, record=bool(args.gantt) and not drawn)
                except ValueError as error:  # e.g. a calibration without this system's backend
                    parser.error(f"{system}: {error}")
            for system, result in results.items():
                plain = f"{result.plain_seconds:.3f}" if result.plain_seconds is not None else ""
                switch = ""
                if result.plain_seconds is not None:
                    chosen = _speedup(results, system, result.chosen_seconds)
                    switch = f"{result.chosen_path} ({chosen})" if chosen else result.chosen_path
                core = f"{100 * result.core_busy:.0f}%" if calibration else ""
                lines.append(f"| {ranks} | {rate} | {system} | {result.seconds:.3f} | "
                             f"{_speedup(results, system, result.seconds)} | {plain} | {switch} | "
                             f"{100 * result.link_busy:.0f}% | {core} | {result.operations:.0f} |")
                rows.append({"ranks": ranks, "bandwidth": rate, "system": system, "seconds": result.seconds,
                             "plain_seconds": result.plain_seconds, "chosen_seconds": result.chosen_seconds,
                             "chosen_path": result.chosen_path if result.plain_seconds is not None else None,
                             "link_busy": result.link_busy, "core_busy": result.core_busy,
                             "operations": result.operations})
            if args.gantt and not drawn:
                from .gantt import draw

                for system, result in results.items():
                    if result.spans:
                        draw(result, gantt_path(args.gantt, system, len(results) > 1),
                             f"simulated {system}: {profile.model}, {ranks} ranks, {rate}, {result.seconds:.3f} s/iter")
                drawn = True
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"profile": json.loads(profile.to_json()), "calibration": args.calibration,
                       "predictions": rows}, handle, indent=1)
    return 0
