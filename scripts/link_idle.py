"""Per iteration, how long the link carried operations and how long it idled, from a bench's traces.

An all-reduce moves only once every rank has launched it, so an operation counts from the
later of the two ranks' launches to the earlier end. The two ranks launch the same
operations in the same order on each lane (rank 0 decides, rank 1 replays), so they are
matched by position. Iterations run from one forward of the first layer (``layer`` 0) to the next;
iterations in which nothing was sent (the framework's own path, whose traffic the
timeline does not record) are left out, and so are those more than 25% off the median
iteration (a block's end and the next one's start: a flush, a barrier, the other systems'
turns).

    bytescheduler bench ... --out DIR        # writes DIR/traces/<system>.rank{0,1}.json
    python scripts/link_idle.py DIR/traces/scheduled.rank0.json DIR/traces/scheduled.rank1.json

A measurement for docs/benchmarks.md ("Where VGG-like's gain stops"), not a test.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Dict, List, Tuple

from bytescheduler_tools.sim.trace import Span as TraceSpan
from bytescheduler_tools.sim.trace import read_spans

Span = Tuple[float, float]


def operations(spans: List[TraceSpan]) -> Dict[str, List[Tuple[float, float, str]]]:
    """(launch, end, name) of each operation, in launch order, per lane (seconds)."""
    lanes: Dict[str, List[Tuple[float, float, str]]] = {}
    for category, name, begin, end, _ in spans:
        if category.startswith("lane"):
            lanes.setdefault(category, []).append((begin, end, name))
    for ops in lanes.values():
        ops.sort()
    return lanes


def union(spans: List[Span]) -> List[List[float]]:
    merged: List[List[float]] = []
    for begin, end in sorted(spans):
        if end <= begin:
            continue
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return merged


def covered(merged: List[List[float]], begin: float, end: float) -> float:
    return sum(max(0.0, min(end, b) - max(begin, a)) for a, b in merged)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rank0")
    parser.add_argument("rank1")
    args = parser.parse_args()
    spans0 = read_spans([args.rank0])[0]
    ops0, ops1 = operations(spans0), operations(read_spans([args.rank1])[0])
    both: List[Span] = []
    lags: List[float] = []
    for lane, first in ops0.items():
        second = ops1.get(lane, [])
        mismatched = sum(1 for a, b in zip(first, second) if a[2] != b[2])
        if len(first) != len(second) or mismatched:
            print(f"{lane}: the ranks' operations differ ({len(first)} and {len(second)}, {mismatched} names "
                  "out of place); matched by position anyway")
        for a, b in zip(first, second):
            both.append((max(a[0], b[0]), min(a[1], b[1])))
            lags.append((b[0] - a[0]) * 1e3)
    link = union(both)
    starts = sorted(begin for category, _, begin, _, args in spans0 if category == "compute" and args.get("layer") == 0)
    rows = []
    for begin, end in zip(starts, starts[1:]):
        busy = covered(link, begin, end)
        if busy > 0:
            rows.append(((end - begin) * 1e3, busy * 1e3))
    if not rows:
        print("no iteration with operations in these traces")
        return 1
    typical = statistics.median(length for length, _ in rows)
    steady = [row for row in rows if abs(row[0] - typical) <= 0.25 * typical]
    print(f"{len(steady)} iterations with operations ({len(rows) - len(steady)} more left out, over 25% off the "
          f"median); rank 1 launches a median {statistics.median(lags):.2f} ms after rank 0")
    rows = steady
    print("| iteration ms | link carrying operations ms | link idle ms |")
    print("|---|---|---|")
    for length, busy in rows:
        print(f"| {length:.1f} | {busy:.1f} | {length - busy:.1f} |")
    print(f"| median {statistics.median(r[0] for r in rows):.1f} | {statistics.median(r[1] for r in rows):.1f} | "
          f"{statistics.median(r[0] - r[1] for r in rows):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
