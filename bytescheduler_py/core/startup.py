"""Which path to start on, predicted from the warm-up and one probe of the link.

Without a prediction the mode switch times both paths (:mod:`.modes`) before it chooses:
on a slow link the first steps then pay for the framework's path, on a fast one for the
schedule's. At the end of the warm-up the ranks instead probe the link together (two
all-reduces of two sizes, :func:`probe_link`), and rank 0 puts what it measured into a
model of both paths (:func:`predict`):

* **the framework's path** (DDP's buckets, in the order gradients arrive, the first of
  ``first_bytes``, the others of ``bucket_bytes``): a bucket is sent once its last
  gradient exists and after the bucket before it; the step ends with the backward or the
  last bucket, whichever is later. What comes after the backward is its *exposed*
  communication.
* **the schedule**: the step takes the compute, plus the communication of what the
  backward produces last (the next forward's first layers wait for it), or the link's
  time for all the gradients, whichever is longer.

The prediction is a mode only where the model is sure by a wide margin: the schedule
when the framework's path is predicted at least :data:`SCHEDULE_GAIN` slower than the
schedule (and not faster than the schedule's measured warm-up steps); the framework's
path when, even on a link :data:`SLOW_LINK` times slower than the probe, its exposed
communication stays below :data:`HIDDEN_SHARE` of the compute (scheduling has nothing to
win and costs CPU) or its step is predicted :data:`SCHEDULE_GAIN` shorter than the
schedule's measured warm-up steps (the schedule's CPU cost, which the model leaves out,
outweighs what it hides: small, fast steps). Anything between is ``None``: the trials
run, as without a prediction. A predicted mode is held for the chooser's short first hold, then re-tried
against the other path like any first choice.

>>> link = LinkProbe(latency_s=0.001, seconds_per_byte=1e-8)   # 100 MB/s
>>> step = StepSample(forward_s=0.2, backward_s=0.3, ready=[(0.0, 50_000_000), (0.3, 1_000)])
>>> predict(step, link, measured_s=0.55).mode                  # 0.5 s to send: DDP 0.70 s, the schedule 0.50 s
'scheduled'
>>> predict(step, LinkProbe(0.0001, 1e-11), measured_s=0.55).mode   # a fast link: nothing to hide
'plain'
>>> predict(step, LinkProbe(0.0001, 5e-9), measured_s=0.55).mode    # 0.25 s to send: too close to call
>>> predict(step, LinkProbe(0.0001, 5e-9), measured_s=0.70).mode    # ... but the schedule measured slow
'plain'
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from .modes import PLAIN, SCHEDULED

# DDP's bucket sizes (its first bucket, and bucket_cap_mb's default).
FIRST_BUCKET_BYTES = 1024**2
BUCKET_BYTES = 25 * 1024**2

SCHEDULE_GAIN = 0.10  # the framework's path predicted this much slower than the schedule
MEASURED_SLACK = 0.03  # ... and not faster than the schedule's warm-up steps by more than this
HIDDEN_SHARE = 0.05  # the framework's exposed communication below this share of the compute
SLOW_LINK = 1.5  # ... even on a link this many times slower than the probe said

# The probe: a small all-reduce (its time is the fixed cost of one; taken five times, its
# spread on a busy machine is most of it) and a large one (the rate, twice), the fastest
# of each kept; the large one is at most the gradients' size.
PROBE_SMALL_BYTES = 4 * 1024
PROBE_LARGE_BYTES = 8 * 1024**2
PROBE_ROUNDS = 2
PROBE_SMALL_ROUNDS = 5


@dataclass(frozen=True)
class LinkProbe:
    """One all-reduce of ``n`` bytes takes ``latency_s + n * seconds_per_byte``."""

    latency_s: float
    seconds_per_byte: float

    def seconds(self, nbytes: int, slower: float = 1.0) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte * slower


@dataclass
class StepSample:
    """Rank 0's step of the schedule, in the warm-up.

    forward_s: compute from the step's start to its first gradient (waits excluded).
    backward_s: from the first gradient to the end of backward (waits excluded).
    ready: ``(seconds after the first gradient, bytes)`` of each gradient (or bucket), in
        the order they arrived.
    period_s: the whole step, waits included, where the sampler sees it (the DDP hook: the
        step is timed by the mode switch from one iteration's first bucket to the next's,
        which also counts whatever the program did between iterations); None elsewhere.
    """

    forward_s: float
    backward_s: float
    ready: List[Tuple[float, int]] = field(default_factory=list)
    period_s: Optional[float] = None

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class Prediction:
    """The mode to start on (None: not sure, trial both) and the model's figures, in seconds."""

    mode: Optional[str]
    plain_s: float
    scheduled_s: float
    measured_s: float
    compute_s: float
    exposed_s: float

    def text(self) -> str:
        return (f"start-up prediction: {self.mode or 'not sure (both paths are tried)'}; the framework's path "
                f"{self.plain_s:.4f} s per step (exposed communication {self.exposed_s:.4f} s), the schedule "
                f"{self.scheduled_s:.4f} s (measured {self.measured_s:.4f} s), compute {self.compute_s:.4f} s")


def _buckets(ready: Sequence[Tuple[float, int]], first_bytes: int, bucket_bytes: int) -> List[Tuple[float, int]]:
    """``(ready time, bytes)`` of each bucket of gradients taken in arrival order (0: one each)."""
    buckets: List[List[float]] = []
    for offset, nbytes in ready:
        limit = first_bytes if len(buckets) <= 1 else bucket_bytes
        if not buckets or buckets[-1][1] >= limit:
            buckets.append([offset, 0])
        buckets[-1][0] = max(buckets[-1][0], offset)
        buckets[-1][1] += nbytes
    return [(offset, int(nbytes)) for offset, nbytes in buckets]


def plain_step(sample: StepSample, link: LinkProbe, first_bytes: int = FIRST_BUCKET_BYTES,
               bucket_bytes: int = BUCKET_BYTES, slower: float = 1.0) -> Tuple[float, float]:
    """The framework's step and its exposed communication (seconds), on a link ``slower``
    times slower than ``link``: its buckets sent one after another, each once it is complete."""
    finish = 0.0
    for ready, nbytes in _buckets(sample.ready, first_bytes, bucket_bytes):
        finish = max(finish, ready) + link.seconds(nbytes, slower)
    exposed = max(0.0, finish - sample.backward_s)
    return sample.compute_s + exposed, exposed


def scheduled_step(sample: StepSample, link: LinkProbe, first_bytes: int = FIRST_BUCKET_BYTES,
                   bucket_bytes: int = BUCKET_BYTES) -> float:
    """The schedule's step: the compute plus the communication of what backward produced last
    (the next forward's first layers need it), or all of the communication, if longer."""
    buckets = _buckets(sample.ready, first_bytes, bucket_bytes)
    total = sum(link.seconds(nbytes) for _, nbytes in buckets)
    last = [nbytes for offset, nbytes in sample.ready if offset >= sample.backward_s * 0.98]
    tail = link.seconds(sum(last)) if last else 0.0
    return max(sample.compute_s + tail, total)


def predict(sample: StepSample, link: LinkProbe, measured_s: float, first_bytes: int = FIRST_BUCKET_BYTES,
            bucket_bytes: int = BUCKET_BYTES, schedules: bool = True) -> Prediction:
    """The path to start on, or None where the model cannot tell them apart by a wide margin
    (see the module's text). ``schedules=False``: the schedule is never predicted (an adapter
    whose scheduled path cannot end a step sooner than the framework's, the DDP hook)."""
    plain, exposed = plain_step(sample, link, first_bytes, bucket_bytes)
    scheduled = scheduled_step(sample, link, first_bytes, bucket_bytes)
    plain_slow, exposed_slow = plain_step(sample, link, first_bytes, bucket_bytes, slower=SLOW_LINK)
    mode = None
    if schedules and plain >= scheduled * (1 + SCHEDULE_GAIN) and plain >= measured_s * (1 - MEASURED_SLACK):
        mode = SCHEDULED
    elif exposed_slow <= HIDDEN_SHARE * sample.compute_s or plain_slow <= measured_s * (1 - SCHEDULE_GAIN):
        mode = PLAIN
    return Prediction(mode, plain, scheduled, measured_s, sample.compute_s, exposed)


def probe_link(all_reduce: Callable[[int, int], None], gradient_bytes: int,
               clock: Callable[[], float] = time.perf_counter) -> LinkProbe:
    """Time all-reduces of two sizes (collective: every rank calls it at the same point).

    ``all_reduce(key, nbytes)`` all-reduces ``nbytes`` (float32) under ``key`` and waits for
    it. The first call, unmeasured, lines the ranks up."""
    large = max(PROBE_SMALL_BYTES * 16, min(PROBE_LARGE_BYTES, gradient_bytes))
    all_reduce(0, PROBE_SMALL_BYTES)
    times = {PROBE_SMALL_BYTES: [], large: []}
    for index in range(max(PROBE_ROUNDS, PROBE_SMALL_ROUNDS)):
        for key, nbytes, rounds in ((1, PROBE_SMALL_BYTES, PROBE_SMALL_ROUNDS), (2, large, PROBE_ROUNDS)):
            if index < rounds:
                begin = clock()
                all_reduce(key, nbytes)
                times[nbytes].append(clock() - begin)
    small_s, large_s = min(times[PROBE_SMALL_BYTES]), min(times[large])
    per_byte = max(0.0, large_s - small_s) / (large - PROBE_SMALL_BYTES)
    return LinkProbe(latency_s=small_s, seconds_per_byte=per_byte)


class StartupPredictor:
    """What a mode switch's driver calls at the warm-up's end (``ModeDriver(startup=...)``).

    Rank 0 adds a :class:`StepSample` per warm-up step but the first (:meth:`add`); at the
    decision point every rank calls :meth:`probe` (collective), and rank 0 gets back the
    ``predict(step_seconds)`` its chooser proposes with.

    Args:
        all_reduce: ``all_reduce(key, nbytes)`` for :func:`probe_link`, on the framework's
            own collective (the one its path would use).
        gradient_bytes: the bytes one step averages (bounds the probe's size).
        leader: rank 0.
        first_bytes, bucket_bytes: the framework's buckets (0: one per gradient).
        schedules: whether the schedule may be predicted (see :func:`predict`).
        report: called on rank 0 with the prediction (for the log).
    """

    def __init__(self, all_reduce: Callable[[int, int], None], gradient_bytes: int, leader: bool,
                 first_bytes: int = FIRST_BUCKET_BYTES, bucket_bytes: int = BUCKET_BYTES, schedules: bool = True,
                 report: Optional[Callable[[Prediction], None]] = None) -> None:
        self._all_reduce = all_reduce
        self._gradient_bytes = gradient_bytes
        self.leader = leader
        self._buckets = (first_bytes, bucket_bytes)
        self._schedules = schedules
        self._report = report
        self.samples: List[StepSample] = []
        self.link: Optional[LinkProbe] = None
        self.prediction: Optional[Prediction] = None

    def add(self, sample: StepSample) -> None:
        if sample.ready:
            self.samples.append(sample)

    def probe(self) -> Optional[Callable[[float], Optional[str]]]:
        """Probe the link (every rank); rank 0's ``predict`` (None elsewhere, or without samples)."""
        self.link = probe_link(self._all_reduce, self._gradient_bytes)
        if not self.leader or not self.samples:
            return None
        return self.predict

    def predict(self, measured_s: float) -> Optional[str]:
        """Rank 0: the mode to start on, from the least disturbed warm-up step (least compute)."""
        sample = min(self.samples, key=lambda s: s.compute_s)
        measured_s = min([measured_s] + [s.period_s for s in self.samples if s.period_s])
        self.prediction = predict(sample, self.link, measured_s, *self._buckets, schedules=self._schedules)
        if self._report is not None:
            self._report(self.prediction)
        return self.prediction.mode
