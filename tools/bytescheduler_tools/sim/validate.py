"""Predictions beside measurements: simulate the runs a ``bytescheduler bench`` recorded.

    python -m bytescheduler_tools.sim.validate docs/bench/matrix/*/results.json \\
        --profiles docs/sim/profiles --calibrations docs/sim/calibration

For each ``results.json`` (one bench run: a model, a link, its systems) the simulator runs
every system the run measured, on 2 ranks, with the link rate the run measured (gloo's
all-reduce; ``none``: loopback, no link limit), the calibration of that link
(``<calibrations>/<rate>.json``, from ``bytescheduler calibrate --bandwidth <rate>``) and
the model's profile (``<profiles>/<model>.json``; measured here and saved when missing),
scaled so that its compute-only iteration equals the run's own ``compute`` row (the
machine's speed that day; a run without one takes another run's of the same model), phase
by phase when the run kept its traces (``traces/compute.json``). A run of fewer systems
replaces the same systems' rows of a larger run of the same model and link (a re-run). A
scheduled system is compared on the path its timed steps took (the mode switch's:
"steps on the framework's path"), and the table also shows which path the simulator's
switch would pick. Prints a markdown table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from typing import Dict, List, Optional, Tuple

from .calibration import Calibration
from .engine import canonical, simulate
from .network import Network, parse_rate
from .profile import Profile, measure, scaled

# The bench's baseline of each scheduled system (its ``baseline`` field says the same).
_BASELINES = {"ddp-hook": "ddp", "scheduled": "ddp", "hvd-scheduled": "hvd", "mxnet-scheduled": "mxnet"}


def traced_phases(folder: str) -> Optional[Tuple[float, float, float]]:
    """The median forward, backward and step of the ``compute`` system on rank 0, from the
    bench's ``traces/compute.json`` beside its results (None when it was not kept)."""
    path = os.path.join(folder, "traces", "compute.json")
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        events = json.load(handle)
    phases = {}
    for name in ("forward", "backward", "step"):
        spans = [e["dur"] / 1e6 for e in events
                 if e.get("cat") == "compute:compute" and e.get("pid") == 0 and e.get("name") == name]
        if not spans:
            return None
        phases[name] = statistics.median(spans)
    return phases["forward"], phases["backward"], phases["step"]


def rate_name(results: dict) -> str:
    """The bench run's ``--bandwidth`` (``none`` for loopback)."""
    match = re.search(r"--bandwidth\s+(\S+)", results.get("command", ""))
    return match.group(1) if match else "none"


def _load_profile(model: str, folder: str) -> Profile:
    path = os.path.join(folder, f"{model}.json")
    if os.path.exists(path):
        with open(path) as handle:
            return Profile.from_json(handle.read())
    profile = measure(model)
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as handle:
        handle.write(profile.to_json())
    return profile


def _compute_rows(runs: List[dict]) -> Dict[str, List[float]]:
    rows: Dict[str, List[float]] = {}
    for results in runs:
        if "compute" in results["systems"]:
            rows.setdefault(results["model"], []).append(results["systems"]["compute"]["median_s"])
    return rows


def compare(runs: List[dict], profiles: str, calibrations: Optional[str], iterations: int = 8,
            folders: Optional[List[str]] = None) -> List[dict]:
    """One row per (run, system): measured and predicted seconds and speedups. A run of fewer
    systems replaces the rows of the same model, link and systems of a larger one (a re-run
    of some systems, as the bench's ``-horovod`` folders are); otherwise a later run's do."""
    compute_rows = _compute_rows(runs)
    rows: Dict[Tuple[str, str, str], dict] = {}
    order = sorted(range(len(runs)), key=lambda number: -len(runs[number]["systems"]))
    for number in order:
        results = runs[number]
        model, rate = results["model"], rate_name(results)
        profile = _load_profile(model, profiles)
        systems = results["systems"]
        own = systems.get("compute", {}).get("median_s")
        compute = own if own is not None else statistics.median(compute_rows.get(model, [profile.compute_s]))
        phases = traced_phases(folders[number]) if folders else None
        if phases is not None:  # the run's own split of forward, backward and step
            profile = scaled(profile, phases[0] / profile.forward_s, phases[1] / profile.backward_s,
                             phases[2] / profile.step_s if profile.step_s else 1.0)
        else:
            profile = scaled(profile, compute / profile.compute_s)
        calibration = None
        if calibrations:
            calibration = Calibration.load(os.path.join(calibrations, f"{rate}.json"))
        bandwidth = parse_rate(rate) if rate in ("none", "loopback") else results["link_bytes_per_s"]
        network = Network(bandwidth, latency=0.0)
        predicted = {}
        for system, measured in systems.items():
            result = simulate(profile, network, results.get("world_size", 2), canonical(system),
                              iterations=iterations, calibration=calibration)
            plain = measured["profile_per_rank"][0].get("plain_fraction")
            on_plain = plain is not None and plain >= 0.5 and result.plain_seconds is not None
            predicted[system] = (result, result.plain_seconds if on_plain else result.seconds, on_plain)
        for system, (result, seconds, on_plain) in predicted.items():
            measured = systems[system]["median_s"]
            baseline = _BASELINES.get(system)
            row = {"model": model, "link": rate, "system": system, "measured_s": measured, "predicted_s": seconds,
                   "error": seconds / measured - 1, "path": "framework" if on_plain else "scheduled"
                   if result.plain_seconds is not None else "", "switch_picks": result.chosen_path
                   if result.plain_seconds is not None else "", "compute_s": compute}
            if baseline in systems and baseline in predicted:
                row["measured_speedup"] = systems[baseline]["median_s"] / measured
                row["predicted_speedup"] = predicted[baseline][1] / seconds
            rows[(model, rate, system)] = row
    return sorted(rows.values(), key=lambda row: (row["model"], row["link"]))


def table(rows: List[dict]) -> str:
    lines = ["| model | link | system | measured s/iter | predicted | error | measured speedup | predicted speedup "
             "| path measured (predicted switch) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        speedups = ("", "")
        if "measured_speedup" in row:
            speedups = (f"{row['measured_speedup']:.2f}x", f"{row['predicted_speedup']:.2f}x")
        path = f"{row['path']} ({row['switch_picks']})" if row["path"] else ""
        lines.append(f"| {row['model']} | {row['link']} | {row['system']} | {row['measured_s']:.3f} | "
                     f"{row['predicted_s']:.3f} | {100 * row['error']:+.0f}% | {speedups[0]} | {speedups[1]} | {path} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bytescheduler_tools.sim.validate", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="bench results.json files")
    parser.add_argument("--profiles", required=True, help="folder of <model>.json profiles (missing ones are measured)")
    parser.add_argument("--calibrations", help="folder of <rate>.json calibrations (none.json, 1gbit.json, ...)")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    runs = []
    for path in args.results:
        with open(path) as handle:
            runs.append(json.load(handle))
    rows = compare(runs, args.profiles, args.calibrations, args.iterations,
                   [os.path.dirname(path) for path in args.results])
    print(table(rows))
    errors = [abs(row["error"]) for row in rows if row["system"] != "compute"]
    if errors:
        within = sum(error <= 0.10 for error in errors)
        print(f"\n{within} of {len(errors)} predictions within 10% of the measurement "
              f"(median error {100 * statistics.median(errors):.1f}%).")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
