"""Benchmark reports: JSON, a markdown table, a bar chart and per-system timelines (PNG).

An iteration is over when the slowest rank is done, so each timed block counts at the
maximum over ranks; the table shows the median over blocks and the spread (min-max).
Floors: *compute* is the compute-only system's time; *sending* is the gradient bytes a
ring all-reduce sends per rank, 2(n-1)/n x bytes, over the link rate measured with a
large all-reduce (the first job's: gloo when the torch job ran). A parameter server with
one server beside each of n workers sends as much per rank. No schedule can beat
max(compute, sending); *of floor* says how close each system came. Each scheduled
system's speedup is over its own framework's baseline (see ``BASELINES``), and its
*attainable gain* is the share it won of what any schedule could win over that baseline,
(baseline - scheduled) / (baseline - floor), with the sending floor at the rate its own
framework measured (gloo, Horovod or ps-lite); negative when it is slower than the baseline.
*Core busy* is the median fraction of a block each rank's pinned CPU was not idle,
kernel network work included: near 100% the CPU, not the link, set the pace.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import statistics
from typing import Dict, List, Optional, Tuple

from bytescheduler.launcher import ENGINE_KEYS, with_engine_env

BASELINES = {"ddp-hook": "ddp", "ddp-torch-hook": "ddp", "ddp-again": "ddp", "ddp-fused": "ddp", "scheduled": "ddp",
             "hvd-scheduled": "hvd", "hvd-again": "hvd", "mxnet-scheduled": "mxnet",
             "mxnet-again": "mxnet"}
# Which link measurement (see runner.LINKS) is each system's own framework's sending rate.
# PyTorch's own ways to train data-parallel (the peers a user would pick today), and the
# systems of ours compared with the fastest of them that ran.
TORCH_PEERS = ("ddp", "ddp-fused", "ddp-torch-hook")
OURS_ON_TORCH = ("ddp-hook", "scheduled")
LINK_OF = {"ddp": "gloo all-reduce", "ddp-hook": "gloo all-reduce", "ddp-torch-hook": "gloo all-reduce",
           "ddp-fused": "gloo all-reduce",
           "ddp-again": "gloo all-reduce", "scheduled": "gloo all-reduce",
           "hvd": "Horovod all-reduce", "hvd-scheduled": "Horovod all-reduce", "hvd-again": "Horovod all-reduce",
           "mxnet": "ps-lite push+pull", "mxnet-scheduled": "ps-lite push+pull",
           "mxnet-again": "ps-lite push+pull"}
LABELS = {
    "compute": "compute only (no communication)",
    "comm": "communication only (all-reduce, no compute)",
    "ddp": "DDP default",
    "ddp-hook": "DDP + scheduled hook",
    "ddp-torch-hook": "DDP + PyTorch's allreduce_hook",
    "ddp-again": "DDP default again (A/A control)",
    "ddp-fused": "DDP + PyTorch's optimizer in backward (_register_fused_optim)",
    "scheduled": "ScheduledOptimizer",
    "hvd": "Horovod DistributedOptimizer",
    "hvd-scheduled": "Horovod + ScheduledOptimizer",
    "hvd-again": "Horovod again (A/A control)",
    "mxnet": "MXNet dist_sync",
    "mxnet-scheduled": "MXNet + ScheduledKVStore",
    "mxnet-again": "MXNet dist_sync again (A/A control)",
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
                "gradient_bytes": result["gradient_bytes"], "stats": {}, "compute_events": [], "profile": {}})
            for name, times in result["times"].items():
                rank["times"].setdefault(name, []).extend(times)
                rank["rss_mib"][name] = max(rank["rss_mib"].get(name, 0.0), result["rss_mib"][name])
                rank["core_busy"].setdefault(name, []).extend(result.get("core_busy", {}).get(name, []))
            rank["stats"].update(result["stats"])
            rank["profile"].update(result.get("profile", {}))
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
            "profile_per_rank": [r.get("profile", {}).get(name) for r in results],
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
            before = summary[baseline]["median_s"]
            entry["speedup"] = before / entry["median_s"]
            entry["baseline"] = baseline
            rate = links.get(LINK_OF.get(name, ""), link)
            own_floor = max(compute or 0.0, 2 * (world - 1) / world * gradient_bytes / rate)
            # Nothing to win when the baseline already runs at the floor.
            entry["attainable_gain"] = (before - entry["median_s"]) / (before - own_floor) \
                if before - own_floor > 0.02 * before else None
        entry["fraction_of_floor"] = floor / entry["median_s"]
    peers = [name for name in TORCH_PEERS if name in summary]
    if len(peers) > 1:  # against the fastest of PyTorch's own ways in this run
        fastest = min(peers, key=lambda name: summary[name]["median_s"])
        for name in OURS_ON_TORCH:
            if name in summary:
                summary[name]["speedup_vs_fastest_peer"] = summary[fastest]["median_s"] / summary[name]["median_s"]
                summary[name]["fastest_peer"] = fastest
    return {
        "systems": summary,
        "floors": {"compute_s": compute, "sending_s": sending, "floor_s": floor},
        "link_bytes_per_s": link,
        "links_bytes_per_s": links,
        "gradient_bytes": gradient_bytes,
        "world_size": world,
        "peak_rss_mib_per_rank": [round(r["peak_rss_mib"], 1) for r in results],
    }


def _engine_note() -> str:
    """The MXNet engine's bulking in force for every MXNet job (:func:`~bytescheduler_tools.bench.runner.mxnet_nodes`)."""
    env = with_engine_env(dict(os.environ))
    return "Every MXNet process, the baseline's too, ran with " + ", ".join(
        f"{key}={env[key]}" for key in ENGINE_KEYS if key in env) + " (MXNet's engine bulking of the backward pass)."


def markdown(summary: dict, header: str) -> str:
    floors = summary["floors"]
    lines = [
        header,
        "",
        "| system | median s/iter | min-max | samples/s | speedup | attainable gain | of floor | RSS MiB/rank | "
        "core busy/rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in summary["systems"].values():
        speedup = f"{entry['speedup']:.2f}x vs {LABELS[entry['baseline']]}" if "speedup" in entry else ""
        if "fastest_peer" in entry and entry["fastest_peer"] != entry.get("baseline"):
            speedup += f"; {entry['speedup_vs_fastest_peer']:.2f}x vs the fastest peer, {LABELS[entry['fastest_peer']]}"
        busy = entry.get("core_busy_per_rank") or []
        gain = entry.get("attainable_gain")
        gain = "" if "speedup" not in entry else "nothing to win" if gain is None else f"{100 * gain:.0f}%"
        lines.append(
            f"| {entry['label']} | {entry['median_s']:.3f} | {entry['min_s']:.3f}-{entry['max_s']:.3f} | "
            f"{entry['samples_per_s']:.1f} | {speedup} | {gain} | {100 * entry['fraction_of_floor']:.0f}% | "
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
    lines += cpu_table(summary)
    settings = [f"{entry['label']} {stats['partition_bytes'] / 2**20:g}/"
                + (f"{stats['credit_bytes'] / 2**20:g} MiB" if stats["credit_bytes"] < 2**50 else "no credit")
                for entry in summary["systems"].values()
                for stats in [entry.get("scheduler") or {}] if "partition_bytes" in stats]
    if settings:
        lines += ["", f"Partition/credit in use at the end (rank 0): {'; '.join(settings)}."]
    if any(LINK_OF.get(name) == "ps-lite push+pull" for name in summary["systems"]):
        lines += ["", "MXNet: one process cannot hold two dist_sync stores, so each MXNet system ran as a job of its "
                  "own (scheduler, a server and a worker per rank); the jobs stayed up together and took turns "
                  "(each one's warm-up, then a block of each per round, the order alternating). "
                  + _engine_note()]
    reasons: Dict[str, List[str]] = {}
    for name, why in summary.get("left_out", {}).items():
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        lines += ["", f"Left out {', '.join(names)}: {why}"]
    return "\n".join(lines)


def cpu_table(summary: dict) -> List[str]:
    """Markdown lines: where each rank's CPU time went per iteration (empty without profiles)."""
    rows = []
    for entry in summary["systems"].values():
        profiles = entry.get("profile_per_rank") or []
        if not profiles or any(not p or not p.get("cpu_ms_per_iteration") for p in profiles):
            continue

        def cell(role: str) -> str:
            return "/".join(f"{p['cpu_ms_per_iteration'].get(role, 0.0):.0f}" for p in profiles)

        ops = profiles[0]["operations_per_iteration"]
        pieces = profiles[0]["pieces_per_iteration"]
        rows.append(f"| {entry['label']} | {1000 * entry['median_s']:.0f} | {cell('training thread')} | "
                    f"{cell('bytescheduler threads')} | {cell('native threads')} | {cell('other Python threads')} | "
                    f"{cell('rest of the core')} | " + (f"{ops:.0f} / {pieces:.0f} |" if ops else "- |"))
    if not rows:
        return []
    details = []
    for entry in summary["systems"].values():
        threads = ((entry.get("profile_per_rank") or [None])[0] or {}).get("bytescheduler_thread_ms_per_iteration")
        threads = {name: ms for name, ms in (threads or {}).items() if ms >= 0.05}  # another system's idle threads
        if threads:
            details.append(f"{entry['label']}: " + ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(threads.items())))
    tail = ["", "bytescheduler's threads on rank 0 (ms per iteration): " + "; ".join(details) + "."] if details else []
    plain = [f"{entry['label']} {100 * fraction:.0f}%" for entry in summary["systems"].values()
             for fraction in [((entry.get("profile_per_rank") or [None])[0] or {}).get("plain_fraction")]
             if fraction is not None]
    if plain:
        tail += ["", "Timed steps on the framework's own path (the adaptive switch's choice and re-trials): "
                 + ", ".join(plain) + "."]
    return ["", "CPU per iteration (ms, rank 0/rank 1), by thread: the training thread (forward, backward, "
            "step, hooks), bytescheduler's threads, native threads (gloo's, Horovod's background thread, "
            "MXNet's engine and ps-lite), other Python threads, and the rest of the rank's core (the kernel's "
            "network work; MXNet's server and scheduler processes); operations / pieces each iteration on rank 0.",
            "", "| system | ms/iter | training thread | bytescheduler | native threads | other Python | rest of core "
            "| operations / pieces |", "|---|---|---|---|---|---|---|---|"] + rows + tail


def machine(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU model and count, so that runs on different machines are not compared as one:
    VGG-like's compute alone took 0.42 s per step in one round and 0.89 s in another (a slow
    hour of a shared machine shows in the compute-only row instead).

    >>> machine("/nonexistent").endswith(" CPUs")
    True
    """
    model = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open(cpuinfo) as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def report(results: List[dict], args, network: str, trace_dir: str, out_dir: str, command: str,
           left_out: Optional[Dict[str, str]] = None) -> str:
    """Write results.json, results.md and the charts into ``out_dir``; return the markdown.

    ``results``: one per rank (see :func:`merge`); ``left_out``: systems not run, and why.
    """
    summary = summarize(results, args.batch_size)
    summary.update({"command": command, "network": network, "model": args.model, "batch_size": args.batch_size,
                    "iterations_per_block": args.iters, "lead_in": args.lead_in, "rounds": args.rounds,
                    "warmup": args.warmup, "from_start": bool(getattr(args, "from_start", False)),
                    "left_out": dict(left_out or {}), "machine": machine()})
    lead_in = summary["lead_in"]
    start = (f", each in the steady state (after {lead_in} untimed iteration{'s' if lead_in > 1 else ''}; "
             "the last one's pending communication waited for after the timed span)" if lead_in
             else ", each from rest to rest")
    if summary["from_start"]:
        start += (f"; the first block right after {args.warmup} warm-up iterations (the mode switch's "
                  "first choice timed too)")
    header = (f"Model {args.model}, batch {args.batch_size} per rank, {summary['world_size']} ranks, {network}; "
              f"{args.rounds} alternating blocks of {args.iters} iterations per system{start}. "
              f"Machine: {summary['machine']}."
              f"\n\nCommand: `{command}`")
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
    except ImportError as error:  # matplotlib: a requirement of bytescheduler-tools, missing where it was installed --no-deps
        table += f"\n\n(no charts: {error}; pip install matplotlib)"
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
