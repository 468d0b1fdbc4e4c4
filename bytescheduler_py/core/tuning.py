"""Auto-tuning: search partition and credit sizes online, by timing training steps.

The tuner is told each time a training step begins (:meth:`AutoTuner.on_step`). It
tries one setting for a few steps, lets the pipeline settle, takes the median step
time, and climbs in powers of two: first the partition size (up, then down), then the
credit as a multiple of the partition. A neighbour is kept only when it is faster by
more than ``threshold`` (noise must not move the setting). When no neighbour helps it
applies the best setting found and stops measuring.

Only the rank that decides the order needs a tuner (rank 0 with an order channel). When
every rank partitions by itself (Horovod), every rank runs a tuner and ``agree`` makes
them see one measurement (rank 0's), so they take the same path and switch settings at
the same step.

>>> applied = []
>>> tuner = AutoTuner(4 << 20, 16 << 20, lambda p, c: applied.append((p, c)), settle_steps=0, measure_steps=1)
>>> tuner.trial
(4194304, 16777216)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from .log import logger

MiB = 1024**2


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:g} MiB"


@dataclass(frozen=True)
class Trial:
    """One measured setting: partition and credit in bytes, median seconds per step."""

    partition_bytes: int
    credit_bytes: int
    seconds_per_step: float

    def __str__(self) -> str:
        return (f"partition {_mib(self.partition_bytes)}, credit {_mib(self.credit_bytes)}: "
                f"{self.seconds_per_step:.4f} s/step")


class AutoTuner:
    """Hill-climbs (partition, credit) on measured step time; see the module docstring.

    Args:
        partition_bytes, credit_bytes: the starting setting (measured first).
        apply: called with ``(partition_bytes, credit_bytes)`` to switch settings.
        agree: maps this rank's measurement to the one every rank uses (default: itself).
        settle_steps: steps skipped after a switch (pieces of the old setting drain).
        measure_steps: steps timed per setting (the median counts).
        threshold: relative gain a neighbour needs to be kept.
        min_partition_bytes, max_partition_bytes, max_credit_multiple: the search box.
        clock: seconds, monotonic (for tests).
    """

    def __init__(
        self,
        partition_bytes: int,
        credit_bytes: int,
        apply: Callable[[int, int], None],
        agree: Optional[Callable[[float], float]] = None,
        settle_steps: int = 3,
        measure_steps: int = 6,
        threshold: float = 0.02,
        min_partition_bytes: int = 256 * 1024,
        max_partition_bytes: int = 256 * MiB,
        max_credit_multiple: int = 16,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if measure_steps < 1 or settle_steps < 0:
            raise ValueError("auto-tuning needs measure_steps >= 1 and settle_steps >= 0")
        self._apply = apply
        self._agree = agree
        self._settle = settle_steps
        self._measure = measure_steps
        self._threshold = threshold
        self._min_partition = min(min_partition_bytes, partition_bytes)
        self._max_partition = max(max_partition_bytes, partition_bytes)
        self._max_multiple = max_credit_multiple
        self._clock = clock
        self.history: List[Trial] = []
        self.best: Optional[Trial] = None
        self.done = False
        self.steps = 0
        # The search: (dimension, direction) moves still to try, current trial, its samples.
        self._moves: List[Tuple[str, int]] = [("partition", 1), ("partition", -1), ("credit", 1), ("credit", -1)]
        self.trial: Tuple[int, int] = (partition_bytes, max(credit_bytes, 1))
        self._last: Optional[float] = None
        self._samples: List[float] = []
        self._skip = 0  # the starting setting is already in place and warm
        self._current_move: Optional[Tuple[str, int]] = None

    @property
    def result(self) -> Optional[Tuple[int, int]]:
        """The chosen (partition_bytes, credit_bytes) once done, else None."""
        if not self.done or self.best is None:
            return None
        return self.best.partition_bytes, self.best.credit_bytes

    def on_step(self) -> None:
        """Record that a training step begins now; may switch the setting."""
        if self.done:
            return
        now = self._clock()
        last, self._last = self._last, now
        self.steps += 1
        if last is None:
            return
        if self._skip > 0:
            self._skip -= 1
            return
        self._samples.append(now - last)
        if len(self._samples) < self._measure:
            return
        measured = statistics.median(self._samples)
        if self._agree is not None:
            measured = float(self._agree(measured))
        self._finish_trial(measured)

    # ------------------------------------------------------------------ search

    def _finish_trial(self, seconds: float) -> None:
        partition, credit = self.trial
        trial = Trial(partition, credit, seconds)
        self.history.append(trial)
        improved = self.best is None or seconds < self.best.seconds_per_step * (1.0 - self._threshold)
        logger.info("auto-tune trial %d: %s%s", len(self.history), trial, " (best so far)" if improved else "")
        if improved:
            previous, self.best = self.best, trial
            if previous is not None:
                # Keep climbing the same way: the move that led here goes first again.
                assert self._current_move is not None
                dimension, direction = self._current_move
                self._moves.insert(0, (dimension, direction))
                # Having moved up, trying down again would return to a measured setting.
                self._moves = [m for m in self._moves if m != (dimension, -direction)]
        self._next_trial()

    def _neighbour(self, dimension: str, direction: int) -> Optional[Tuple[int, int]]:
        assert self.best is not None
        partition, credit = self.best.partition_bytes, self.best.credit_bytes
        multiple = max(1, round(credit / partition))
        if dimension == "partition":
            partition = partition * 2 if direction > 0 else partition // 2
            if not self._min_partition <= partition <= self._max_partition:
                return None
        else:
            multiple = multiple * 2 if direction > 0 else multiple // 2
            if not 1 <= multiple <= self._max_multiple:
                return None
        candidate = (partition, partition * multiple)
        tried = {(t.partition_bytes, t.credit_bytes) for t in self.history}
        return None if candidate in tried else candidate

    def _next_trial(self) -> None:
        while self._moves:
            move = self._moves.pop(0)
            candidate = self._neighbour(*move)
            if candidate is not None:
                self._current_move = move
                self._start(candidate)
                return
        self.done = True
        assert self.best is not None
        self.trial = (self.best.partition_bytes, self.best.credit_bytes)
        self._apply(*self.trial)
        first = self.history[0]
        logger.info(
            "auto-tune done after %d steps and %d trials: %s (the starting setting gave %.4f s/step)",
            self.steps, len(self.history), self.best, first.seconds_per_step,
        )

    def _start(self, candidate: Tuple[int, int]) -> None:
        self.trial = candidate
        self._samples = []
        self._skip = self._settle
        self._apply(*candidate)
