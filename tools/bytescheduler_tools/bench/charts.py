"""PNG charts of a benchmark: a bar chart of iteration times and a Gantt chart per system."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "step": "#55a868", "all-reduce": "#8172b3",
           "lane0": "#c44e52", "lane1": "#937860", "task": "#bbbbbb", "update": "#64b5cd", "copy": "#ccb974",
           "dispatch": "#8c8c8c", "negotiate": "#da8bc3", "push": "#c44e52", "reply": "#937860", "server": "#8172b3"}


def bar_chart(summary: dict, path: str) -> None:
    systems = summary["systems"]
    names = list(systems)
    medians = [systems[n]["median_s"] for n in names]
    low = [systems[n]["median_s"] - systems[n]["min_s"] for n in names]
    high = [systems[n]["max_s"] - systems[n]["median_s"] for n in names]
    figure, axes = plt.subplots(figsize=(9, 0.6 * len(names) + 1.5))
    axes.barh([systems[n]["label"] for n in names], medians, xerr=[low, high], color="#4c72b0", capsize=3)
    floor = summary["floors"]["floor_s"]
    axes.axvline(floor, color="#c44e52", linestyle="--", label=f"floor max(compute, sending) = {floor:.3f} s")
    axes.set_xlabel("seconds per iteration (median, min-max over blocks)")
    axes.invert_yaxis()
    axes.legend(loc="lower right")
    axes.set_title(f"{summary['model']}, batch {summary['batch_size']}, {summary['network']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def speedup_chart(by_rate: Dict[str, List[Tuple[int, float]]], by_ranks: Dict[int, List[Tuple[float, float]]],
                  title: str, path: str) -> None:
    """Predicted speedup (``bytescheduler sweep``) against ranks, a line per link rate, and
    against the link rate (Gbit/s), a line per number of ranks; both axes logarithmic."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axes, lines, label, legend in ((left, by_rate, "ranks (one link each)", "link rate"),
                                       (right, by_ranks, "link rate per rank (Gbit/s)", "ranks")):
        for name, points in lines.items():
            points = sorted(points)
            axes.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=str(name))
        axes.axhline(1.0, color="#777777", linestyle="--", linewidth=0.8)
        axes.set_xscale("log", base=2 if axes is left else 10)
        axes.set_xlabel(label)
        axes.legend(title=legend, fontsize=7, title_fontsize=8)
    left.set_ylabel("predicted speedup")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _iteration_window(compute: List[dict], period_us: Optional[float] = None) -> Tuple[float, float]:
    """The last two traced iterations on rank 0: from the start of the last but one to about the end.

    An iteration starts with an all-reduce (communication only) or with the first of a run
    of forward spans (MXNet's forward is split where the engine waits for weights). When
    that finds no plausible iteration (shorter than half the measured ``period_us``, as when
    MXNet's profiler interleaves the next forward with the backward), the window is the last
    two measured periods.
    """
    events = sorted(compute, key=lambda e: e["ts"])
    end = max(e["ts"] + e["dur"] for e in compute)
    starts = [e["ts"] for i, e in enumerate(events) if e["name"] == "all-reduce"
              or (e["name"] == "forward" and (i == 0 or events[i - 1]["name"] != "forward"))]
    if len(starts) >= 2 and (period_us is None or starts[-1] - starts[-2] > period_us / 2):
        return starts[-2], starts[-1] + (starts[-1] - starts[-2])
    if period_us is not None:
        return end - 2 * period_us, end
    return (starts[0] if starts else end - 1.0), end


def timeline_chart(system: str, label: str, compute_events: List[dict], traces: List[dict], path: str,
                   rank0: int = 0, period_s: Optional[float] = None, rows_of: Tuple[str, ...] = ("lane",)) -> None:
    """Gantt chart of compute and communication per rank over the last two traced iterations.

    ``period_s``: the measured seconds per iteration, when known (see :func:`_iteration_window`).
    ``rows_of``: the async spans whose category starts with one of these get a row per
    category (the lanes; the simulator's threads too); a span's colour is its ``kind``
    argument, else its category.
    """
    compute = [e for e in compute_events if e["cat"] == f"compute:{system}"]
    if not compute:
        return
    start, end = _iteration_window([e for e in compute if e["pid"] == rank0],
                                   None if period_s is None else period_s * 1e6)
    start -= 0.05 * (end - start)
    rows: Dict[str, List[Tuple[float, float, str]]] = defaultdict(list)
    for event in compute:
        rows[f"rank {event['pid']} compute"].append((event["ts"], event["ts"] + event["dur"], event["name"]))
    begins = {}
    for event in traces:
        if event["ph"] not in ("b", "e"):
            continue
        key = (event["pid"], event["id"])
        if event["ph"] == "b":
            begins[key] = event
        elif event["ph"] == "e" and key in begins:
            begin = begins.pop(key)
            if begin["cat"].startswith(rows_of):
                kind = begin.get("args", {}).get("kind", begin["cat"])
                rows[f"rank {event['pid']} {begin['cat']}"].append((begin["ts"], event["ts"], kind))
    height = 0.5 * len(rows) + 1.8
    figure, axes = plt.subplots(figsize=(11, height))
    labels = sorted(rows)
    drawn = set()
    for y, row in enumerate(labels):
        spans = [(a, b, kind) for a, b, kind in rows[row] if b > start and a < end]
        for a, b, kind in spans:
            axes.barh(y, (b - a) / 1e3, left=(a - start) / 1e3, height=0.6, color=_COLORS.get(kind, "#777777"),
                      edgecolor="white", linewidth=0.3)
            drawn.add(kind)
    axes.set_yticks(range(len(labels)))
    axes.set_yticklabels(labels)
    axes.invert_yaxis()
    axes.set_xlim(0, (end - start) / 1e3)
    axes.set_xlabel("milliseconds (about two iterations, rank 0's clock)")
    kinds = [kind for kind in _COLORS if kind in drawn] or list(_COLORS)
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS[kind]) for kind in kinds]
    figure.legend(handles, kinds, ncol=len(kinds), fontsize=7, loc="lower center")
    axes.set_title(label)
    figure.tight_layout(rect=(0, 0.35 / height, 1, 1))  # room for the legend below the axis label
    figure.savefig(path, dpi=110)
    plt.close(figure)
