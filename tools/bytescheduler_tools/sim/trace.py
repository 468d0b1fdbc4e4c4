"""A profile from a recorded run: the Chrome trace ScheduledOptimizer writes with a timeline on.

A run with ``timeline`` (``BYTESCHEDULER_TIMELINE=trace.json``, or ``bytescheduler
bench``, whose ``traces/`` folder holds ``scheduled.rank0.json``) records, per rank, a
span for each gradient's task (its size, its ready moment) and, since the simulator needs
them (:mod:`bytescheduler.pytorch.compute_timeline`), spans of category ``compute``: each
parameter-owning module's forward, the backward pass and each batch of updates. This
module turns one rank's spans into a :class:`~bytescheduler_tools.sim.profile.Profile`: per
layer, the median forward time over the recorded iterations; per gradient, its size and
its median moment after the backward began; the median backward; the median of each
iteration's update time (the step's arithmetic). A bench ``compute.json`` given as well
supplies the step time when the run took the framework's path (no update spans).

>>> spans = [("compute", "a", 0.0, 1.0, {"layer": 0}), ("compute", "b", 1.0, 3.0, {"layer": 1}),
...          ("compute", "backward", 3.0, 7.0, {}), ("task", "a.weight", 6.5, 8.0, {"bytes": 40}),
...          ("task", "b.weight", 4.0, 8.0, {"bytes": 80}), ("compute", "update", 7.5, 8.0, {"bytes": 120})]
>>> p = profile_from_spans(spans)
>>> [(l.name, l.forward_s, [(t.nbytes, t.ready_s) for t in l.tensors]) for l in p.layers], p.backward_s, p.step_s
([('a', 1.0, [(40, 3.5)]), ('b', 2.0, [(80, 1.0)])], 4.0, 0.5)
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

from .profile import Layer, Profile, Tensor

# (category, name, start seconds, end seconds, args)
Span = Tuple[str, str, float, float, Dict[str, Any]]


class TraceError(ValueError):
    """The trace lacks what a profile needs."""


def read_spans(paths: List[str], rank: Optional[int] = None) -> Tuple[List[Span], List[Span]]:
    """One rank's spans (the lowest rank found unless ``rank``): the timeline's async spans and
    the bench's compute spans (``compute.json``), in seconds."""
    events: List[dict] = []
    for path in paths:
        try:
            with open(path) as handle:
                loaded = json.load(handle)
        except (OSError, ValueError) as error:
            raise TraceError(f"cannot read the trace {path!r}: {error}") from None
        events.extend(loaded["traceEvents"] if isinstance(loaded, dict) else loaded)
    pids = sorted({e["pid"] for e in events if e.get("ph") in ("b", "X")})
    if not pids:
        raise TraceError(f"no spans in {', '.join(paths)}: give a timeline written with BYTESCHEDULER_TIMELINE")
    rank = pids[0] if rank is None else rank
    opened: Dict[tuple, dict] = {}
    spans: List[Span] = []
    bench: List[Span] = []
    for event in events:
        if event.get("pid") != rank:
            continue
        phase = event.get("ph")
        if phase == "X":
            bench.append((event.get("cat", ""), event["name"], event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6, {}))
        elif phase == "b":
            opened[(event.get("cat"), event["id"])] = event
        elif phase == "e":
            begin = opened.pop((event.get("cat"), event["id"]), None)
            if begin is not None:
                spans.append((begin.get("cat", ""), begin["name"], begin["ts"] / 1e6, event["ts"] / 1e6,
                              begin.get("args", {})))
    return spans, bench


def _owner(param: str, layers: Dict[str, int]) -> Optional[int]:
    """The layer (module name) a parameter name belongs to: its longest module prefix."""
    module = param.rsplit(".", 1)[0] if "." in param else "model"
    while True:
        if module in layers:
            return layers[module]
        if "." not in module:
            return layers.get("model")
        module = module.rsplit(".", 1)[0]


def profile_from_spans(spans: List[Span], bench: Optional[List[Span]] = None, model: str = "trace") -> Profile:
    """A profile from one rank's spans (see the module docstring)."""
    forwards = sorted((s for s in spans if s[0] == "compute" and "layer" in s[4]), key=lambda s: s[2])
    backwards = sorted((s for s in spans if s[0] == "compute" and s[1] == "backward"), key=lambda s: s[2])
    if not forwards or not backwards:
        raise TraceError("the trace has no per-layer compute spans: record it with ScheduledOptimizer and a "
                         "timeline (BYTESCHEDULER_TIMELINE=trace.json) with this version of bytescheduler")
    names: Dict[int, str] = {}
    forward_times: Dict[int, List[float]] = defaultdict(list)
    for _, name, start, end, args in forwards:
        names[args["layer"]] = name
        forward_times[args["layer"]].append(end - start)
    layer_of = {name: index for index, name in names.items()}
    ready: Dict[str, List[float]] = defaultdict(list)
    sizes: Dict[str, int] = {}
    keys: Dict[str, int] = {}
    updates = sorted((s for s in spans if s[0] == "compute" and s[1] == "update"), key=lambda s: s[2])
    step_times = []
    for number, (_, _, begin, end, _) in enumerate(backwards):
        following = backwards[number + 1][2] if number + 1 < len(backwards) else float("inf")
        for category, name, start, _, args in spans:
            if category == "task" and begin <= start <= end + 1e-3:
                ready[name].append(start - begin)
                sizes[name] = int(args.get("bytes", 0))
                keys[name] = int(args.get("key", len(keys)))
        applied = [u for u in updates if begin <= u[2] < following]
        if applied:
            step_times.append(sum(u[3] - u[2] for u in applied))
    if not ready:
        raise TraceError("the trace has no gradient tasks inside its backward passes: record the scheduled path "
                         "(adaptive=False, or a run whose mode switch kept the schedule)")
    tensors: Dict[int, List[Tuple[int, float]]] = defaultdict(list)
    for name in sorted(ready, key=lambda n: keys[n]):  # the parameters' order in the model
        layer = _owner(name, layer_of)
        if layer is None:
            layer = max(names)
        tensors[layer].append((sizes[name], statistics.median(ready[name])))
    step = statistics.median(step_times) if step_times else _bench_step(bench or [])
    layers = tuple(Layer(names[i], statistics.median(forward_times[i]),
                         tuple(Tensor(size, moment) for size, moment in tensors.get(i, [])))
                   for i in sorted(names))
    return Profile(model, layers, statistics.median(b[3] - b[2] for b in backwards), step)


def _bench_step(bench: List[Span]) -> float:
    steps = [end - start for category, name, start, end, _ in bench if name == "step"]
    return statistics.median(steps) if steps else 0.0


def profile_from_trace(paths: List[str], model: str = "trace", rank: Optional[int] = None) -> Profile:
    """The profile of one rank (default: the lowest) of the run recorded in ``paths``."""
    spans, bench = read_spans(paths, rank)
    return profile_from_spans(spans, bench, model)
