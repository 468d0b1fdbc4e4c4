"""A Gantt PNG of simulated iterations, drawn like the bench's timeline pictures.

The simulation's recorded phases (``simulate(..., record=True)``) become the events
:func:`bytescheduler_tools.bench.charts.timeline_chart` draws for a measured run: the training
thread's row (each layer's forward, the backward, copies and the step) and one row per
communication thread (each lane, Horovod's background thread, the parameter servers'
connections, the updater, our dispatcher), about two iterations of the one simulated rank.

>>> from bytescheduler_tools.sim.events import Span
>>> events = chart_events([Span("compute", "x", "forward", 0.0, 0.1), Span("lane0", "lane0", "lane0", 0.05, 0.2)])
>>> [(e["cat"], e["ph"], e["ts"]) for e in events[0]], [(e["cat"], e["ph"]) for e in events[1]]
([('compute:simulated', 'X', 0.0)], [('lane0', 'b'), ('lane0', 'e')])
"""

from __future__ import annotations

from typing import List, Tuple

from .engine import Result
from .events import Span

SYSTEM = "simulated"
COMPUTE_ROW = "compute"


def chart_events(spans: List[Span]) -> Tuple[List[dict], List[dict]]:
    """(compute events, async thread events) in the bench trace's form, microseconds, rank 0."""
    compute, threads = [], []
    for number, span in enumerate(spans):
        start, end = span.start * 1e6, span.end * 1e6
        if span.row == COMPUTE_ROW:
            compute.append({"name": span.kind, "cat": f"compute:{SYSTEM}", "ph": "X", "pid": 0, "tid": 1,
                            "ts": start, "dur": end - start})
        else:
            base = {"cat": span.row, "id": number, "pid": 0, "tid": 0, "name": span.name}
            threads.append(dict(base, ph="b", ts=start, args={"kind": span.kind}))
            threads.append(dict(base, ph="e", ts=end))
    return compute, threads


def draw(result: Result, path: str, label: str) -> None:
    """Draw ``result``'s recorded phases (simulate with ``record=True``) to the PNG ``path``."""
    from ..bench.charts import timeline_chart

    if not result.spans:
        raise ValueError(f"{result.system}: nothing recorded to draw; simulate with record=True")
    compute, threads = chart_events(list(result.spans))
    rows = tuple(sorted({event["cat"] for event in threads}))
    timeline_chart(SYSTEM, label, compute, threads, path, period_s=result.seconds, rows_of=rows or ("lane",))
