"""What the mode switch's choosing costs over a training of a given length.

The mode switch (:class:`~bytescheduler.core.modes.ModeChooser`) finds the faster of the
scheduled path and the framework's own path by running both: trials at the start, a
second look at a first choice that was not decisive, then re-trials of the slower path
after holds that double up to ``max_hold``. Every step of the slower path is a cost,
paid mostly at the start. A bench of 60 or 640 timed steps sees that start; a training of
thousands of steps sees little of it. This module feeds the real chooser synthetic step
times and tells how far a training of N steps is from always running the faster path:

>>> cost = choosing_cost(step_seconds=0.1, speedup=0.8, steps=(60, 10_000))
>>> cost[60] > cost[10_000]
True
>>> cost[10_000] < 0.005
True

``speedup`` is the scheduled path's speed over the plain path's (0.8: the schedule's
steps take 1.25 times as long; 1.15: 15% faster). Step times get noise of ``noise`` (a
fraction of the step, standard deviation) that comes in runs: each step's noise keeps
``correlation`` of the one before, as on this shared machine, where slow steps come
several in a row.

``prediction`` is what the start-up prediction (:mod:`bytescheduler.core.startup`) says
at the warm-up's end: ``"none"`` (not sure, or turned off: the trials run), ``"right"`` or
``"wrong"`` (the faster or the slower path is held from then on, until its re-trial), or
``"sure"``: right where the two paths differ by the model's margin (10%) or more, none
elsewhere, which is how the prediction is built to behave.

``python -m bytescheduler_tools.sim.choosing`` prints the tables of docs/benchmarks.md:
without the prediction and with it (``--prediction`` for one of them alone).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from typing import Dict, Iterable, List, Optional, Sequence

from bytescheduler.core.modes import PLAIN, SCHEDULED, ModeChooser
from bytescheduler.core.startup import SCHEDULE_GAIN

CHECKPOINTS = (13, 60, 320, 1000, 3000, 10_000)
PREDICTIONS = ("none", "right", "wrong", "sure")
SURE = 1 + SCHEDULE_GAIN  # the start-up model's margin


def choosing_cost(step_seconds: float, speedup: float, steps: Iterable[int] = CHECKPOINTS,
                  noise: float = 0.03, correlation: float = 0.5, seed: int = 0,
                  chooser: Optional[ModeChooser] = None, prediction: str = "none") -> Dict[int, float]:
    """For each N in ``steps``: the share of the first N steps' time lost against always
    running the faster path (0.01: the training took 1% longer), one noisy run.

    ``step_seconds`` is the plain path's step (the chooser sets its trials' length from
    it); the noise is the same on both paths at each step (the machine's, not the path's).
    """
    if step_seconds <= 0 or speedup <= 0 or noise < 0 or not 0 <= correlation < 1:
        raise ValueError("step_seconds and speedup must be positive, noise at least 0, correlation in [0, 1)")
    checkpoints = sorted(set(steps))
    if not checkpoints or checkpoints[0] < 1:
        raise ValueError("steps must be positive step counts")
    if prediction not in PREDICTIONS:
        raise ValueError(f"prediction must be one of {PREDICTIONS}, not {prediction!r}")
    rng = random.Random(seed)
    chooser = chooser or ModeChooser()
    faster, slower = (SCHEDULED, PLAIN) if speedup > 1 else (PLAIN, SCHEDULED)
    said = {"none": None, "right": faster, "wrong": slower,
            "sure": faster if max(speedup, 1 / speedup) >= SURE - 1e-9 else None}[prediction]
    scheduled = step_seconds / speedup
    best = min(step_seconds, scheduled)
    spent = ideal = 0.0
    drift = 0.0
    innovation = noise * math.sqrt(1 - correlation ** 2)
    cost: Dict[int, float] = {}
    for step in range(1, checkpoints[-1] + 1):
        drift = correlation * drift + rng.gauss(0.0, innovation)
        factor = max(0.1, 1.0 + drift)
        seconds = (scheduled if chooser.mode == SCHEDULED else step_seconds) * factor
        spent += seconds
        ideal += best * factor
        chooser.record(seconds)
        if chooser.end_step():
            chooser.adopt(chooser.propose(lambda measured: said))
        if step in checkpoints:
            cost[step] = spent / ideal - 1.0
    return cost


def median_cost(step_seconds: float, speedup: float, steps: Sequence[int] = CHECKPOINTS,
                runs: int = 10, prediction: str = "none", **noise: float) -> Dict[int, List[float]]:
    """:func:`choosing_cost` over ``runs`` seeds: for each N, ``[median, worst]``."""
    results = [choosing_cost(step_seconds, speedup, steps, seed=seed, prediction=prediction, **noise)
               for seed in range(runs)]
    return {n: [statistics.median(r[n] for r in results), max(r[n] for r in results)] for n in results[0]}


def table(step_times: Sequence[float], speedups: Sequence[float], runs: int, noise: float,
          correlation: float, prediction: str = "none") -> str:
    """A markdown table: one row per step time and speed-up, the cost after each checkpoint."""
    head = ("| plain step s | schedule's speed-up | "
            + " | ".join(f"{n:,} steps" for n in CHECKPOINTS) + " |")
    lines = [head, "|" + "---|" * (2 + len(CHECKPOINTS))]
    for step in step_times:
        for speedup in speedups:
            cost = median_cost(step, speedup, CHECKPOINTS, runs, prediction, noise=noise, correlation=correlation)
            cells = " | ".join(f"{100 * cost[n][0]:.1f}% ({100 * cost[n][1]:.1f}%)" for n in CHECKPOINTS)
            lines.append(f"| {step:g} | {speedup:g}x | {cells} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bytescheduler_tools.sim.choosing",
        description="The mode switch's choosing cost over a training: the share of time lost against always "
                    "running the faster path (median of the runs, in brackets the worst), fed to the real "
                    "ModeChooser with synthetic step times.")
    parser.add_argument("--steps", type=float, nargs="+", default=[0.017, 0.11, 1.0],
                        help="the plain path's step times in seconds")
    parser.add_argument("--speedups", type=float, nargs="+", default=[0.67, 0.8, 0.95, 1.05, 1.15, 1.35],
                        help="the schedule's speed over the plain path's (below 1: slower)")
    parser.add_argument("--runs", type=int, default=10, help="noisy runs (seeds) per row")
    parser.add_argument("--noise", type=float, default=0.03, help="step-time noise, a fraction of the step")
    parser.add_argument("--correlation", type=float, default=0.5,
                        help="share of a step's noise that carries over to the next (runs of slow steps)")
    parser.add_argument("--prediction", choices=PREDICTIONS, default=None,
                        help="the start-up prediction's say (default: two tables, none and sure)")
    args = parser.parse_args(argv)
    for index, prediction in enumerate([args.prediction] if args.prediction else ["none", "sure"]):
        title = {"none": "Without a start-up prediction (trials first)",
                 "right": "The start-up prediction right every time",
                 "wrong": "The start-up prediction wrong every time",
                 "sure": f"With the start-up prediction (the faster path where the paths differ by "
                         f"{SCHEDULE_GAIN:.0%} or more, none elsewhere)"}[prediction]
        print(("\n" if index else "") + title + ":\n")
        print(table(args.steps, args.speedups, args.runs, args.noise, args.correlation, prediction))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
