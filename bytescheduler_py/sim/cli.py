"""``bytescheduler simulate``: predicted seconds per iteration of each system, any ranks and rate.

    bytescheduler simulate --model vgg --ranks 2 --bandwidth 1gbit --systems ddp scheduled
    bytescheduler simulate --model vgg --ranks 2 8 64 --bandwidth 10gbit 25gbit --json out.json

The model's profile is measured on this machine first (a few iterations, one thread), built
in (``--model vgg16-v100``, ``resnet50-v100``, ``transformer-v100``: :mod:`.paper`), or read
with ``--profile FILE`` (written by ``--save-profile FILE``). Several ranks or rates sweep
every combination.
"""

from __future__ import annotations

import argparse
import json
from typing import List, Optional

from ..core.config import parse_size
from .engine import SYSTEMS, default_config, simulate
from .inputs import add_network_arguments, add_profile_arguments, network_from, profile_from


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bytescheduler simulate", description=__doc__.splitlines()[0])
    add_profile_arguments(parser)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--bandwidth", nargs="+", default=["1gbit"], help="each rank's link, e.g. 1gbit 25gbit")
    add_network_arguments(parser)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--partition", help="partition size for the scheduled systems (default: the adapter's)")
    parser.add_argument("--credit", help="credit size for the scheduled systems (default: the adapter's)")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--json", help="also write the predictions to this JSON file")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    profile = profile_from(args)
    options = {}
    if args.partition:
        options["partition_bytes"] = parse_size(args.partition, "--partition")
    if args.credit:
        options["credit_bytes"] = parse_size(args.credit, "--credit")
    rows, lines = [], []
    lines.append(f"Profile {profile.model}: {len(profile.layers)} layers, {profile.gradient_bytes / 2**20:.1f} MiB of "
                 f"gradients, forward {profile.forward_s * 1e3:.1f} ms, backward {profile.backward_s * 1e3:.1f} ms, "
                 f"step {profile.step_s * 1e3:.1f} ms.")
    lines += ["", "| ranks | bandwidth | system | predicted s/iter | speedup vs DDP | link busy | operations/iter |",
              "|---|---|---|---|---|---|---|"]
    for ranks in args.ranks:
        for rate in args.bandwidth:
            network = network_from(args, rate)
            results = {}
            for system in args.systems:
                config = default_config(system)
                if options and system in ("ddp-hook", "scheduled"):
                    config = config.with_options(**options)
                results[system] = simulate(profile, network, ranks, system, config, args.iterations)
            ddp = results.get("ddp")
            for system, result in results.items():
                speedup = f"{ddp.seconds / result.seconds:.2f}x" if ddp and system != "ddp" and result.seconds else ""
                lines.append(f"| {ranks} | {rate} | {system} | {result.seconds:.3f} | {speedup} | "
                             f"{100 * result.link_busy:.0f}% | {result.operations:.0f} |")
                rows.append({"ranks": ranks, "bandwidth": rate, "system": system, "seconds": result.seconds,
                             "link_busy": result.link_busy, "operations": result.operations})
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"profile": json.loads(profile.to_json()), "predictions": rows}, handle, indent=1)
    return 0
