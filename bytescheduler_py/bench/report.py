"""Benchmark reports: JSON, a markdown table, a bar chart and per-system timelines (PNG).

An iteration is over when the slowest rank is done, so each timed block counts at the
maximum over ranks; the table shows the median over blocks and the spread (min-max).
Floors: *compute* is the compute-only system's time; *sending* is the gradient bytes a
ring all-reduce sends per rank, 2(n-1)/n x bytes, over the link rate measured with a
large all-reduce (the first job's: gloo when the torch job ran). A parameter server with
one server beside each of n workers sends as much per rank. No schedule can beat
max(compute, sending); the last column says how close each system came. Each scheduled
system's speedup is over its own framework's baseline (see ``BASELINES``).
*Core busy* is the median fraction of a block each rank's pinned CPU was not idle,
kernel network work included: near 100% the CPU, not the link, set the pace.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from typing import Dict, List, Optional, Tuple

BASELINES = {"ddp-hook": "ddp", "scheduled": "ddp", "hvd-scheduled": "hvd", "mxnet-scheduled": "mxnet"}
LABELS = {
    "compute": "compute only (no communication)",
    "comm": "communication only (all-reduce, no compute)",
    "ddp": "DDP default",
    "ddp-hook": "DDP + scheduled hook",
    "scheduled": "ScheduledOptimizer",
    "hvd": "Horovod DistributedOptimizer",
    "hvd-scheduled": "Horovod + ScheduledOptimizer",
    "mxnet": "MXNet dist_sync",
    "mxnet-scheduled": "MXNet + ScheduledKVStore",
}


def merge(jobs: List[Tuple[str, List[dict]]]) -> List[dict]:
    """One result per rank from the per-rank results of several jobs, each ``(link kind, results)``.

    A system's blocks from several jobs are concatenated in job order; RSS figures are
    maxima; the link measured by each kind of job is kept (the first measurement) in
    ``links``; compute events are gathered.
    """
    merged: Dict[int, dict] = {}
    for kind, results in jobs:
        for result in results:
            rank = merged.setdefault(result["rank"], {
                "rank": result["rank"], "times": {}, "rss_mib": {}, "core_busy": {}, "peak_rss_mib": 0.0, "links": {},
                "gradient_bytes": result["gradient_bytes"], "stats": {}, "compute_events": []})
            for name, times in result["times"].items():
                rank["times"].setdefault(name, []).extend(times)
                rank["rss_mib"][name] = max(rank["rss_mib"].get(name, 0.0), result["rss_mib"][name])
                rank["core_busy"].setdefault(name, []).extend(result.get("core_busy", {}).get(name, []))
            rank["stats"].update(result["stats"])
            rank["compute_events"] += result["compute_events"]
            rank["peak_rss_mib"] = max(rank["peak_rss_mib"], result["peak_rss_mib"])
            if result["link_bytes_per_s"] and kind not in rank["links"]:
                rank["links"][kind] = result["link_bytes_per_s"]
    return [merged[rank] for rank in sorted(merged)]


def summarize(results: List[dict], batch_size: int) -> dict:
    """Per system: median, min, max seconds per iteration (max over ranks per block), and more.

    ``results``: one per rank, as :func:`merge` makes them.
    """
    world = len(results)
    summary: Dict[str, dict] = {}
    for name in results[0]["times"]:
        blocks = [max(block) for block in zip(*(r["times"][name] for r in results))]
        median = statistics.median(blocks)
        summary[name] = {
            "label": LABELS.get(name, name),
            "median_s": median,
            "min_s": min(blocks),
            "max_s": max(blocks),
            "blocks_s": blocks,
            "samples_per_s": world * batch_size / median,
            "rss_mib_per_rank": [round(r["rss_mib"][name], 1) for r in results],
            # Median fraction of a block each rank's (pinned) core was busy; None when not pinned.
            "core_busy_per_rank": [round(statistics.median(r["core_busy"][name]), 3) if r["core_busy"].get(name)
                                   else None for r in results],
            "scheduler": results[0]["stats"].get(name) or None,
        }
    links = {kind: min(r["links"][kind] for r in results) for kind in results[0]["links"]}
    link = next(iter(links.values()))
    gradient_bytes = results[0]["gradient_bytes"]
    sending = 2 * (world - 1) / world * gradient_bytes / link
    compute = summary["compute"]["median_s"] if "compute" in summary else None
    floor = max(compute or 0.0, sending)
    for name, entry in summary.items():
        baseline = BASELINES.get(name)
        if baseline in summary:
            entry["speedup"] = summary[baseline]["median_s"] / entry["median_s"]
            entry["baseline"] = baseline
        entry["fraction_of_floor"] = floor / entry["median_s"]
    return {
        "systems": summary,
        "floors": {"compute_s": compute, "sending_s": sending, "floor_s": floor},
        "link_bytes_per_s": link,
        "links_bytes_per_s": links,
        "gradient_bytes": gradient_bytes,
        "world_size": world,
        "peak_rss_mib_per_rank": [round(r["peak_rss_mib"], 1) for r in results],
    }


def markdown(summary: dict, header: str) -> str:
    floors = summary["floors"]
    lines = [
        header,
        "",
        "| system | median s/iter | min-max | samples/s | speedup | of floor | RSS MiB/rank | core busy/rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in summary["systems"].values():
        speedup = f"{entry['speedup']:.2f}x vs {LABELS[entry['baseline']]}" if "speedup" in entry else ""
        busy = entry.get("core_busy_per_rank") or []
        lines.append(
            f"| {entry['label']} | {entry['median_s']:.3f} | {entry['min_s']:.3f}-{entry['max_s']:.3f} | "
            f"{entry['samples_per_s']:.1f} | {speedup} | {100 * entry['fraction_of_floor']:.0f}% | "
            f"{'/'.join(f'{v:.0f}' for v in entry['rss_mib_per_rank'])} | "
            f"{'/'.join('-' if v is None else f'{100 * v:.0f}%' for v in busy)} |"
        )
    compute = f"{floors['compute_s']:.3f} s" if floors["compute_s"] is not None else "not measured"
    links = [f"{rate * 8 / 1e9:.2f} Gbit/s per direction by {kind}"
             for kind, rate in summary["links_bytes_per_s"].items()]
    others = f"; also {', '.join(links[1:])}" if len(links) > 1 else ""
    lines += [
        "",
        f"Floors: compute {compute}; sending {floors['sending_s']:.3f} s "
        f"({summary['gradient_bytes'] / 2**20:.1f} MiB of gradients, link measured at "
        f"{links[0]}{others}); floor = max = {floors['floor_s']:.3f} s.",
    ]
    if any(v is not None for entry in summary["systems"].values() for v in entry.get("core_busy_per_rank") or []):
        lines += ["", "Core busy: the median share of a block each rank's CPU was not idle (its processes "
                  "and the kernel's network work on it); near 100% the CPU, not the link, set the pace."]
    settings = [f"{entry['label']} {stats['partition_bytes'] / 2**20:g}/"
                + (f"{stats['credit_bytes'] / 2**20:g} MiB" if stats["credit_bytes"] < 2**50 else "no credit")
                for entry in summary["systems"].values()
                for stats in [entry.get("scheduler") or {}] if "partition_bytes" in stats]
    if settings:
        lines += ["", f"Partition/credit in use at the end (rank 0): {'; '.join(settings)}."]
    if any(name in summary["systems"] for name in ("mxnet", "mxnet-scheduled")):
        lines += ["", "MXNet: one process cannot hold two dist_sync stores, so each MXNet block ran as a job of its "
                  "own (scheduler, a server and a worker per rank), alternating by round."]
    reasons: Dict[str, List[str]] = {}
    for name, why in summary.get("left_out", {}).items():
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        lines += ["", f"Left out {', '.join(names)}: {why}"]
    return "\n".join(lines)


def report(results: List[dict], args, network: str, trace_dir: str, out_dir: str, command: str,
           left_out: Optional[Dict[str, str]] = None) -> str:
    """Write results.json, results.md and the charts into ``out_dir``; return the markdown.

    ``results``: one per rank (see :func:`merge`); ``left_out``: systems not run, and why.
    """
    summary = summarize(results, args.batch_size)
    summary.update({"command": command, "network": network, "model": args.model, "batch_size": args.batch_size,
                    "iterations_per_block": args.iters, "rounds": args.rounds, "left_out": dict(left_out or {})})
    header = (f"Model {args.model}, batch {args.batch_size} per rank, {summary['world_size']} ranks, {network}; "
              f"{args.rounds} alternating blocks of {args.iters} iterations per system.\n\nCommand: `{command}`")
    table = markdown(summary, header)
    with open(os.path.join(out_dir, "results.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as handle:
        handle.write(table + "\n")
    compute_events = [event for r in results for event in r["compute_events"]]
    with open(os.path.join(trace_dir, "compute.json"), "w") as handle:  # beside the schedulers' traces
        json.dump(compute_events, handle)
    try:
        from . import charts
    except ImportError as error:  # matplotlib is optional (the [bench] extra)
        table += f"\n\n(no charts: {error}; install bytescheduler[bench])"
        return table
    charts.bar_chart(summary, os.path.join(out_dir, "speed.png"))
    for name in summary["systems"]:
        traces = _load_traces(trace_dir, name)
        path = os.path.join(out_dir, f"timeline-{name}.png")
        charts.timeline_chart(name, LABELS.get(name, name), compute_events, traces, path, results[0]["rank"],
                              period_s=summary["systems"][name]["median_s"])
    return table


def _load_traces(trace_dir: str, system: str) -> List[dict]:
    events: List[dict] = []
    for path in sorted(glob.glob(os.path.join(trace_dir, f"{system}.rank*.json"))):
        with open(path) as handle:
            events.extend(json.load(handle))
    return events
