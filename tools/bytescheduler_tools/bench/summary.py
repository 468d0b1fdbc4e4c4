"""``bytescheduler bench-summary``: one table of every scheduled system from many bench runs.

    bytescheduler bench-summary bench-results/*/results.json

Each ``bytescheduler bench`` run alternates the systems of one model and rate; this reads
the ``results.json`` of several runs and prints, per model and rate, every scheduled
system's speedup over its own framework's baseline (from the run's alternating blocks),
the share of the attainable gain, the share of timed steps the mode switch ran on the
framework's own path, and the median, worst and best of the per-round ratios (each
round's two blocks run back to back, so the median of their ratios is the figure drift
moves least; the range says how much to trust it). A speedup below 1.00x is marked: the
project's bar is never slower.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Iterable, List, Optional


def _rate(network: str) -> str:
    """The link of a run, from its network description ('... shaped to 1gbit each way ...')."""
    found = re.search(r"shaped to (\d+(?:\.\d+)?)([gm])bit", network.lower())
    if not found:
        return "loopback"
    return f"{found.group(1)} {'Gbit/s' if found.group(2) == 'g' else 'Mbit/s'}"


def _round_ratios(system: dict, baseline: dict) -> List[float]:
    return [b / s for s, b in zip(system.get("blocks_s") or [], baseline.get("blocks_s") or []) if s > 0]


def rows(results: Iterable[dict]) -> List[List[str]]:
    """Table rows: model, rate, system, s/iter (ours / baseline), speedup, per-round ratios
    (median and range), attainable gain, plain steps."""
    table = []
    for result in results:
        systems = result["systems"]
        for entry in systems.values():
            baseline_name = entry.get("baseline")
            if not baseline_name or baseline_name not in systems:
                continue
            baseline = systems[baseline_name]
            ratios = _round_ratios(entry, baseline)
            spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else ""
            speedup = entry.get("speedup")
            mark = " (slower)" if speedup is not None and speedup < 0.995 else ""
            gain = entry.get("attainable_gain")
            profile = (entry.get("profile_per_rank") or [None])[0] or {}
            plain = profile.get("plain_fraction")
            table.append([
                result.get("model", "?"), _rate(result.get("network", "")), entry["label"],
                f"{entry['median_s']:.3f} / {baseline['median_s']:.3f}",
                f"{speedup:.2f}x{mark}" if speedup is not None else "",
                spread,
                "" if gain is None else f"{100 * gain:.0f}%",
                "" if plain is None else f"{100 * plain:.0f}%",
            ])
    return table


def markdown(table: List[List[str]]) -> str:
    header = ["model", "link", "system", "s/iter (ours / baseline)", "speedup", "per-round ratios: median (range)",
              "attainable gain", "steps on the framework's path"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="bytescheduler bench-summary", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json files (or folders holding one)")
    args = parser.parse_args(argv)
    loaded = []
    for path in args.results:
        path = path / "results.json" if path.is_dir() else path
        with open(path, encoding="utf-8") as handle:
            loaded.append(json.load(handle))
    order = {"loopback": 0, "1 Gbit/s": 1, "2 Gbit/s": 2}
    table = sorted(rows(loaded), key=lambda row: (row[0], order.get(row[1], 9), row[2]))
    print(markdown(table))
    slower = [row for row in table if "(slower)" in row[4]]
    if slower:
        medians = statistics.median(float(row[4].split("x")[0]) for row in slower)
        print(f"\n{len(slower)} of {len(table)} rows below 1.00x (median of those {medians:.2f}x).")
    return 0
