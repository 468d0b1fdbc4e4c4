"""Scheduled or plain: rank 0 chooses, from measured step times, whether scheduling pays.

Scheduling costs CPU on every rank (a Python hook per gradient, a dispatcher, an updater
and the read guard on the training thread). Where communication is hidden anyway (a small
model, a fast link) that cost is all there is, and the framework's own path (gradients
averaged in a few large buckets during backward, one full ``step()``) is faster. Nothing
predicts that reliably from a model's shape, so :class:`ModeChooser` measures: it runs
both paths for a few steps, keeps the faster, and now and then tries the other again for
a few steps, in case the situation changed (the link got slower, a bigger batch).

The chooser is pure: it is fed rank 0's step times and answers with the mode to run.
Which steps run which mode is a function of the step count and of the decisions taken
so far, so every rank keeps an identical chooser and only the decisions travel: at a
*decision point* (:meth:`ModeChooser.end_step` returns True) rank 0 calls
:meth:`~ModeChooser.propose` and every rank calls :meth:`~ModeChooser.adopt` with what
rank 0 proposed (an adapter's one small collective).

>>> chooser = ModeChooser(ModeSwitchParams(warmup=1, settle=0, trial=2, pairs=1))
>>> times = {SCHEDULED: 1.0, PLAIN: 0.5}
>>> for _ in range(20):
...     chooser.record(times[chooser.mode])
...     if chooser.end_step():
...         chooser.adopt(chooser.propose())
>>> chooser.mode, chooser.decisions, chooser.choices
('plain', 2, 1)
"""

from __future__ import annotations

import enum
import math
import statistics
import time
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .errors import as_library_error
from .values import parse_bool

SCHEDULED = "scheduled"
PLAIN = "plain"
MODES = (SCHEDULED, PLAIN)

# What rank 0 proposes at a decision point (small integers, for a collective). A proposal
# may also carry the length of the trials to come: ``code + 4 * steps`` (:func:`encode`).
CONTINUE, CHOOSE_SCHEDULED, CHOOSE_PLAIN, STOP = 0, 1, 2, 3
_CHOICE = {SCHEDULED: CHOOSE_SCHEDULED, PLAIN: CHOOSE_PLAIN}



class Phase(enum.Enum):
    """Where a :class:`ModeChooser` is; each phase runs one mode for a number of steps."""

    WARMUP = "warmup"  # the first steps, scheduled; their times set the trials' length
    TRIAL = "trial"  # a trial phase of one mode; a scheduled one is followed by a plain one
    HOLD = "hold"  # the chosen mode runs; its last steps are the re-trial's reference
    RETRIAL = "retrial"  # the other mode again, for a few steps
    BACK = "back"  # the held mode again after a re-trial, timed as the other half of its reference
    FIXED = "fixed"  # choosing stopped for good: the scheduled mode stays


# In a CHOOSE proposal, the "steps" that mean: chosen by a decisive difference (a longer hold;
# any other first choice is looked at again soon).
CLEAR = 1


# After the warm-up, a CONTINUE may also carry the mode predicted to win (:mod:`.startup`):
# that mode is then held at once instead of trialled against the other.
_PREDICTED_UNIT = 4 * 4096  # steps stay below 4096 (ModeSwitchParams.max_trial)
_PREDICTED = {None: 0, SCHEDULED: 1, PLAIN: 2}


def encode(code: int, steps: int = 0, predicted: Optional[str] = None) -> int:
    """A proposal: ``code`` (CONTINUE, CHOOSE_*, STOP) and, if not 0, the trials' length in
    steps (CONTINUE) or :data:`CLEAR` (CHOOSE_*); after the warm-up, the mode ``predicted``
    to win, if any.

    >>> decode(encode(CONTINUE, 12, PLAIN)), predicted_mode(encode(CONTINUE, 12, PLAIN))
    ((0, 12), 'plain')
    """
    return code + 4 * steps + _PREDICTED_UNIT * _PREDICTED[predicted]


def decode(proposal: int) -> Tuple[int, int]:
    """``(code, steps)`` of a proposal (see :func:`encode`)."""
    return proposal % 4, (proposal % _PREDICTED_UNIT) // 4


def predicted_mode(proposal: int) -> Optional[str]:
    """The mode a proposal says to start on (None: none predicted)."""
    return {number: mode for mode, number in _PREDICTED.items()}[proposal // _PREDICTED_UNIT]


def _other(mode: str) -> str:
    return PLAIN if mode == SCHEDULED else SCHEDULED


@dataclass(frozen=True)
class ModeSwitchParams:
    """How the mode switch times the two paths: one set for every rank (rank 0's is agreed).

    Given as ``SchedulerConfig(mode_switch=...)``, as a keyword of any adapter
    (``mode_switch=ModeSwitchParams(hold=400)`` or a dict of these fields), or as
    ``BYTESCHEDULER_MODE_SWITCH="hold=400,trial_seconds=1"``; without one, each adapter uses
    the defaults below (the MXNet store leaves two steps untimed after a switch, ``settle=2``).
    The rules they set are in docs/design.md ("The mode switch").

    Attributes:
        warmup: steps before the first trial (first iterations are slow), in the scheduled mode.
            Its end is a decision point: rank 0 sets the trials' length from the warm-up's
            step times, so a trial lasts at least ``trial_seconds``.
        settle: steps after each switch, and after each decision point reached on the
            scheduled path, that are not timed: both drain the scheduled path, and the step
            after a drain waits for nothing of the step before it (it is short).
        trial: timed steps per trial phase, at least (at most ``max_trial``).
        pairs: at most this many (scheduled, plain) trial pairs; after each pair, a
            difference larger than ``clear`` decides at once if it is also larger than the
            noise (otherwise the next pair is timed, and the samples of all pairs pool).
        hold: steps the faster path runs before the slower one is tried again: a re-trial of
            it (``min_retrial`` steps at least), then as many of the held path again. The
            re-trial is compared with the held path's steps just before and just after it, so
            a machine that slows down or speeds up meanwhile weighs on both sides; the held
            path stays unless the re-trial's is faster beyond the noise, except a schedule
            that a re-trial switched to: at its next re-trial it must lead again, or a tie
            goes to the plain path. Doubled each time a re-trial confirms the choice, up to
            ``max_hold``. Every hold (``verify_hold`` and ``max_hold`` too) is given for
            re-trials of ``min_retrial`` steps: where the warm-up makes trials, and so
            re-trials, longer (fast steps), the holds grow in proportion, so a re-trial of
            the slower path stays as small a share of the steps. A first choice by a
            difference larger than ``decisive`` (a fraction of the slower path's step) and
            than the noise holds ``clear_hold`` times as long; any other first choice is
            looked at again after ``verify_hold`` steps (at most ``hold``): trial pairs timed
            back to back can be wrong, and a second look costs little where paths are close.
        margin: the scheduled path is kept only when its median step is faster than the
            plain path's by more than this fraction, and by more than the measured noise
            (two and a half standard errors of the medians; both taken over pairs of
            consecutive steps, :func:`_paired`): ties, and differences the samples cannot
            tell apart, go to the cheaper, plain path. After all ``pairs`` trial pairs, the
            pace of whole trial phases (:func:`paced`) also decides: a path whose every
            phase beats the other's next to it, beyond the phases' noise, wins; where the
            two readings disagree, the plain path runs.
        clear: a difference this large (and beyond the noise) decides after one trial pair,
            once each path has at least ``min_clear_samples`` timed steps. Where the warm-up
            makes a trial at least twice ``min_retrial`` steps long (fast steps), each trial
            goes as two or three shorter phases a side, alternating (up to ``pairs`` times as
            many pairs), and an early decision also needs three pairs whose phases' pace
            (:func:`paced`) agrees: the machine's slow steps come in runs, which one long
            phase a side can catch on one side only.
        min_retrial: a re-trial, and the held path's steps after it, last at least this many
            steps (else ``trial``), so both sides are timed in pairs (:func:`_paired`); and it
            switches only when the other path's lead is beyond the noise of each side taken
            alone (at first choices the two sides' noise is averaged).
        trial_seconds, max_trial: a trial lasts at least this long (from the warm-up's median
            step), in at most ``max_trial`` steps.
        clear_hold, decisive, verify_hold: see ``hold``.
        min_clear_samples: see ``clear``.
        predict: at the warm-up's end, probe the link and start on the path that a model of
            both predicts to win, where it is sure by a wide margin (:mod:`.startup`; held
            for ``verify_hold`` steps, then re-tried like any first choice); where it is not
            sure, and with ``predict=False``, both paths are tried first.

    >>> params = ModeSwitchParams.parse("hold=400,trial_seconds=1.5")
    >>> params.hold, params.trial_seconds, params.warmup
    (400, 1.5, 3)
    """

    warmup: int = 3
    settle: int = 1
    trial: int = 4
    pairs: int = 3
    hold: int = 200
    max_hold: int = 3200
    margin: float = 0.01
    clear: float = 0.10
    trial_seconds: float = 0.5
    max_trial: int = 64
    clear_hold: int = 4
    min_clear_samples: int = 8
    decisive: float = 0.20
    verify_hold: int = 50
    min_retrial: int = 8
    predict: bool = True

    def __post_init__(self) -> None:
        if (min(self.warmup, self.trial, self.pairs, self.hold, self.verify_hold, self.min_retrial) < 1
                or self.settle < 0 or not self.trial <= self.max_trial < 4096 or self.trial_seconds < 0):
            raise ValueError("warmup, trial, pairs, hold, verify_hold and min_retrial must be at least 1, settle and "
                             "trial_seconds at least 0, and max_trial at least trial and below 4096")

    def text(self) -> str:
        """The fields that differ from the defaults, as :meth:`parse` reads them (e.g. for
        ``BYTESCHEDULER_MODE_SWITCH``).

        >>> ModeSwitchParams(hold=400, margin=0.02).text()
        'hold=400,margin=0.02'
        >>> params = ModeSwitchParams(hold=400, margin=0.02)
        >>> ModeSwitchParams.parse(params.text()) == params
        True
        """
        changed = [f.name for f in fields(self) if getattr(self, f.name) != f.default]
        return ",".join(f"{name}={getattr(self, name)!r}" for name in changed)

    @classmethod
    def parse(cls, value: Any, name: str = "mode_switch") -> "ModeSwitchParams":
        """``value`` as parameters: a :class:`ModeSwitchParams`, a mapping of its fields, or a
        string ``"field=value,field=value"`` (an environment variable's form)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                pairs = [item.split("=", 1) for item in value.replace(" ", "").split(",") if item]
                value = {key: val for key, val in pairs}
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a list of field=value pairs, e.g. 'hold=400,trial=8'") \
                    from None
        if not isinstance(value, Mapping):
            raise TypeError(f"{name} must be a ModeSwitchParams, a dict of its fields or a 'field=value,...' "
                            f"string, not {type(value).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise TypeError(f"{name}: unknown mode-switch parameter(s) {unknown}; use any of {sorted(known)}")
        parsed = {}
        for key, val in value.items():
            if known[key].type in ("bool", bool):
                parsed[key] = parse_bool(val, f"{name}: {key}")
                continue
            kind = float if known[key].type in ("float", float) else int
            try:
                parsed[key] = kind(val)
            except (TypeError, ValueError):
                raise ValueError(f"{name}: {key}={val!r} is not a{'' if kind is int else ' real'} number") from None
            if kind is int and isinstance(val, float) and val != int(val):
                raise ValueError(f"{name}: {key}={val!r} must be a whole number of steps")
        return cls(**parsed)


class ModeChooser:
    """Which path runs each step: trials of both, a hold of the faster, short re-trials.

    ``params`` sets the phases' lengths and the rules' thresholds (:class:`ModeSwitchParams`);
    ``start`` is :data:`SCHEDULED` (times both paths first) or :data:`PLAIN`: start with a
    hold of the plain path, as if it had been chosen (a plan's advice, ``start_plain``); it
    counts as the first choice. The phases (:class:`Phase`): a warm-up, then trial pairs
    until a verdict, a hold of the faster, a re-trial of the other and the held mode back,
    a verdict, a hold again; or fixed for good (a rank vetoed choosing).

    Times are seconds per step, recorded on rank 0 only (other ranks never call
    :meth:`record` or :meth:`propose`).
    """

    def __init__(self, params: Optional[ModeSwitchParams] = None, start: str = SCHEDULED) -> None:
        params = params if params is not None else ModeSwitchParams()
        if not isinstance(params, ModeSwitchParams):
            raise TypeError(f"params must be a ModeSwitchParams, not {type(params).__name__}")
        if start not in MODES:
            raise ValueError(f"start must be {SCHEDULED!r} or {PLAIN!r}, not {start!r}")
        self.params = params
        # The trials' length and its phases, set from rank 0's warm-up (adopt).
        self.trial = params.trial
        self.split, self.phase_steps = 1, params.trial  # trial phases per trial length, and their steps
        # The holds, given for re-trials of min_retrial steps, scaled with longer re-trials (adopt).
        self.first_hold, self.verify_hold, self.max_hold = params.hold, min(params.verify_hold, params.hold), \
            params.max_hold
        self.mode = SCHEDULED
        self.decisions = 0  # decision points passed
        # rank 0: every choice made, with the step times it was made from (for reports)
        self.verdicts: List[Dict[str, Any]] = []
        self.choices = 0  # decision points that chose a mode (0: still choosing the first)
        self._runs: List[List] = []  # [mode, steps] of the steps ended, run-length encoded
        self._phase = Phase.WARMUP
        self._length = params.warmup
        self._done = 0  # steps of the current phase
        self._samples: List[float] = []  # timed steps of the current phase
        self._settling = 0
        self._phases: Dict[str, List[List[float]]] = {SCHEDULED: [], PLAIN: []}  # trial steps, phase by phase
        self._pairs_run = 0
        self._hold = params.hold
        self._verifying = False  # the hold now running is a first choice's short one
        self._predicted = False  # ... and that choice was the start-up prediction's
        self._tentative = False  # the schedule is held because one re-trial switched to it: it must lead again
        self._held: List[float] = []  # the hold's last timed steps (half the re-trial's reference)
        self._retried: List[float] = []  # the re-trial's timed steps, while the held mode runs again
        if start == PLAIN:
            self.choices = 1
            self.mode = PLAIN  # from the first step on: nothing to settle
            self._start(Phase.HOLD, PLAIN, params.hold)

    @property
    def phase(self) -> Phase:
        """The phase now running (the same on every rank)."""
        return self._phase

    @property
    def settle(self) -> int:
        """Untimed steps after each switch (and each drain of the scheduled path)."""
        return self.params.settle

    @property
    def history(self) -> List[str]:
        """The mode of every step ended, in order."""
        return [mode for mode, steps in self._runs for _ in range(steps)]

    @property
    def retrial(self) -> int:
        """Steps of a re-trial, and of the held path's steps after it."""
        return max(self.trial, self.params.min_retrial)

    @property
    def steady_steps(self) -> Optional[int]:
        """Steps from now on that surely run the current mode (the rest of a hold; 0 while
        choosing, re-trying or settling back), None once choosing stopped for good (every
        step stays scheduled). The same on every rank."""
        if self._phase == Phase.FIXED:
            return None
        return self._length - self._done if self._phase == Phase.HOLD else 0

    @property
    def unread_steps(self) -> int:
        """Steps from now on (the current one included) whose times no choice will read: a
        hold's steps before its last :attr:`retrial` ones (the re-trial's reference, see
        :meth:`record`); 0 in every other phase. The same on every rank.

        >>> chooser = ModeChooser(ModeSwitchParams(hold=20, min_retrial=8), start=PLAIN)
        >>> chooser.unread_steps, [chooser.end_step() for _ in range(12)][-1], chooser.unread_steps
        (12, False, 0)
        """
        return max(0, (self.steady_steps or 0) - self.retrial)

    @property
    def fixed(self) -> bool:
        """True once choosing stopped for good (:meth:`adopt` of :data:`STOP`): the scheduled path stays."""
        return self._phase == Phase.FIXED

    # ------------------------------------------------------------------ every rank

    def end_step(self) -> bool:
        """A step ended (before :meth:`record` of the next). True: a decision point, agree now."""
        if self._runs and self._runs[-1][0] == self.mode:
            self._runs[-1][1] += 1
        else:
            self._runs.append([self.mode, 1])
        if self._phase == Phase.FIXED:
            return False
        self._done += 1
        if self._done < self._length:
            return False
        if self._phase == Phase.HOLD:
            self._start(Phase.RETRIAL, _other(self.mode), self.retrial)
            return False
        if self._phase == Phase.TRIAL:
            self._phases[self.mode].append(self._samples)
            if self.mode == SCHEDULED:
                self._start(Phase.TRIAL, PLAIN, self.phase_steps)
                return False
            self._pairs_run += 1
        if self._phase == Phase.RETRIAL:  # back to the held mode, timed as the other half of the reference
            self._retried = self._samples
            self._start(Phase.BACK, _other(self.mode), self.retrial)
            return False
        return True  # the warm-up, a trial pair or a re-trial (and the steps back) is complete

    def adopt(self, proposal: int) -> None:
        """Apply rank 0's :meth:`propose` at a decision point (on every rank alike)."""
        self.decisions += 1
        drained = self.mode == SCHEDULED  # the driver drained the scheduled path for this decision
        code, extra = decode(proposal)
        if code == STOP:
            self._phase, self.mode = Phase.FIXED, SCHEDULED
            return
        if code == CONTINUE:
            if self._phase not in (Phase.WARMUP, Phase.TRIAL):
                raise ValueError("CONTINUE is only proposed after the warm-up or a trial pair")
            predicted = predicted_mode(proposal)
            if predicted is not None and self._phase != Phase.WARMUP:
                raise ValueError("a predicted mode is only proposed after the warm-up")
            if extra:
                self.trial = extra  # the trials' length, from rank 0's warm-up
                # Long trials (fast steps) go as up to three shorter phases a side, alternating:
                # the machine's noise comes in runs of slow steps, which one long phase a side
                # can catch on one side only, and whole phases' pace needs three pairs.
                self.split = max(1, min(3, extra // self.params.min_retrial))
                self.phase_steps = math.ceil(extra / self.split)
                scale = self.retrial / self.params.min_retrial  # the holds keep the re-trials' share of steps
                given = (self.params.hold, min(self.params.verify_hold, self.params.hold), self.params.max_hold)
                self.first_hold, self.verify_hold, self.max_hold = (math.ceil(h * scale) for h in given)
            if predicted is not None:
                # Start on the predicted path, held as a first choice that is not decisive:
                # its re-trial, after the short hold, is the trials' confirmation.
                self.choices += 1
                self._verifying = self.verify_hold < self.first_hold
                self._predicted = True
                self._start(Phase.HOLD, predicted, self.verify_hold, drained)
                return
            self._start(Phase.TRIAL, SCHEDULED, self.phase_steps, drained)
            return
        chosen = SCHEDULED if code == CHOOSE_SCHEDULED else PLAIN
        self.choices += 1
        hold = None
        tentative = False
        if self._phase == Phase.BACK:
            confirmed = chosen == self.mode  # back on the held mode after the re-trial
            grown = self.first_hold if self._verifying else min(self._hold * 2, self.max_hold)
            if confirmed and self._predicted and extra == CLEAR:  # the prediction's re-trial, decisive
                grown = min(self.first_hold * self.params.clear_hold, self.max_hold)
            self._hold = grown if confirmed else self.first_hold
            tentative = not confirmed and chosen == SCHEDULED
        elif extra == CLEAR:
            self._hold = min(self.first_hold * self.params.clear_hold, self.max_hold)
        else:  # a first choice from trials, not decisive: a second look soon
            hold = self.verify_hold
        self._verifying = hold is not None and hold < self.first_hold
        self._predicted = False
        self._tentative = tentative
        self._phases = {SCHEDULED: [], PLAIN: []}
        self._pairs_run = 0
        self._held, self._retried = [], []
        self._start(Phase.HOLD, chosen, self._hold if hold is None else hold, drained)

    def _start(self, phase: Phase, mode: str, length: int, drained: bool = False) -> None:
        """Begin ``phase`` on ``mode``: after a switch or a drain of the scheduled path (``drained``),
        its first ``settle`` steps are not timed."""
        switched = mode != self.mode
        self._phase, self.mode = phase, mode
        self._settling = self.params.settle if switched or drained else 0
        self._length = length + self._settling
        self._done = 0
        self._samples = []

    # ------------------------------------------------------------------ rank 0

    def record(self, seconds: Optional[float]) -> None:
        """Rank 0: the step now ending took ``seconds`` (None: unknown, e.g. the first step)."""
        if seconds is None or self._phase == Phase.FIXED:
            return
        if self._done < self._settling:
            return
        self._samples.append(seconds)
        if self._phase == Phase.HOLD:
            self._held = (self._held + [seconds])[-self.retrial:]

    def propose(self, predict: Optional[Callable[[float], Optional[str]]] = None) -> int:
        """Rank 0 at a decision point: what every rank should do next.

        ``predict(step_seconds)``, after the warm-up: the mode predicted to win from the
        warm-up's median step (None: not sure); that mode is then held without trials."""
        if self._phase == Phase.WARMUP:
            step = _median(self._samples[1:] or self._samples)  # the first step is the slowest
            params = self.params
            steps = params.trial if not step else math.ceil(params.trial_seconds / step)
            predicted = predict(step) if predict is not None and step else None
            if predicted is not None:
                self.verdicts.append({"kind": "prediction", "step": sum(steps for _, steps in self._runs),
                                      "winner": predicted, "told_apart": True, "clear": False})
            return encode(CONTINUE, max(params.trial, min(params.max_trial, steps)), predicted)
        if self._phase == Phase.BACK:
            # The held mode's steps just before the re-trial and just after it, against the
            # re-trial's: a machine that slows down or speeds up meanwhile weighs on both sides.
            held = self._held + self._samples  # the hold's last steps (record keeps ``retrial``)
            if not held or not self._retried:
                return _CHOICE[self.mode]  # nothing to compare: stay on the held mode
            samples = {self.mode: held, _other(self.mode): self._retried}
            winner, told_apart, (scheduled, plain) = verdict(samples, self.params.margin, each_side=True)
            if not told_apart:
                # A re-trial looks for a change: the held path, chosen on evidence, stays unless
                # the other is faster beyond the noise (a pipelined schedule's steps spread
                # widely, and on a tie it lost to a steadier but slower plain path). A schedule
                # held only since one re-trial of a few steps switched to it is not such a
                # choice: it must lead again, or the plain path runs (an eight-step re-trial can
                # catch a run of slow steps on the held side).
                winner = PLAIN if self._tentative else self.mode  # tentative: the schedule is held
            # The first re-trial of a predicted path is its first timed comparison: a decisive
            # confirmation holds as long as a decisive choice from trials would.
            decisive = (self._predicted and told_apart and winner == self.mode
                        and abs(scheduled - plain) >= self.params.decisive * max(scheduled, plain))
            self._note("re-trial", samples, winner, told_apart, decisive)
            return encode(_CHOICE[winner], CLEAR if decisive else 0)
        samples = {mode: [t for phase in self._phases[mode] for t in phase] for mode in MODES}  # pooled
        if not samples[SCHEDULED] or not samples[PLAIN]:
            return CONTINUE if self._pairs_run < self.params.pairs * self.split else CHOOSE_SCHEDULED
        winner, told_apart, (scheduled, plain) = verdict(samples, self.params.margin)
        # A large difference decides at once, and holds longer, only when the samples tell
        # it apart from the noise; otherwise more pairs are timed (their samples pool).
        enough = min(len(samples[SCHEDULED]), len(samples[PLAIN])) >= self.params.min_clear_samples
        clear = enough and told_apart and abs(scheduled - plain) >= self.params.clear * max(scheduled, plain)
        if clear and self.split > 1:  # split trials: the phases' pace must agree, from three pairs on
            clear = self._pairs_run >= 3 and paced(self._phases, self.params.margin) == winner
        if self._pairs_run < self.params.pairs * self.split and not clear:
            return CONTINUE
        if not clear:
            by_pace = paced(self._phases, self.params.margin)
            if by_pace is not None and told_apart and by_pace != winner:
                winner, told_apart = PLAIN, False  # the two readings disagree: a tie
            elif by_pace is not None:
                winner, told_apart = by_pace, True
        self._note("trials", samples, winner, told_apart, clear)
        decisive = clear and abs(scheduled - plain) >= self.params.decisive * max(scheduled, plain)
        return encode(_CHOICE[winner], CLEAR if decisive else 0)

    def _note(self, kind: str, samples: Dict[str, List[float]], winner: str, told_apart: bool, clear: bool) -> None:
        """Keep a verdict and the step times behind it (:attr:`verdicts`)."""
        self.verdicts.append({"kind": kind, "step": sum(steps for _, steps in self._runs), "winner": winner, "told_apart": told_apart,
                              "clear": clear, **{f"{mode}_s": [round(t, 6) for t in samples[mode]] for mode in MODES}})


def paced(phases: Dict[str, List[List[float]]], margin: float) -> Optional[str]:
    """The faster path by the pace of whole trial phases, or None where they cannot tell.

    A pipelined path's steps can repeat a pattern longer than two (a long step every three or
    four), which pairs of steps (:func:`_paired`) still count as noise. The mean step of each
    trial phase is the path's pace over the phase, the figure a training run's throughput
    follows, and each scheduled phase runs right before a plain one, so their ratio is a
    paired comparison (a machine that drifts moves both). With at least three pairs of
    phases, a path is faster when every pair says so by more than ``margin`` and the ratios'
    mean by more than three standard errors of it. A step longer than three times the median
    step of both paths (e.g. the machine busy with something else) counts as three medians.

    >>> pattern = [1.33, 1.05, 2.02, 1.2]  # steps of a schedule's phase
    >>> paced({SCHEDULED: [pattern] * 3, PLAIN: [[1.5, 1.45, 1.45, 1.5]] * 3}, margin=0.01)
    'scheduled'
    >>> paced({SCHEDULED: [pattern] * 3, PLAIN: [[1.5, 1.45, 1.45, 1.5]] * 2 + [[1.2, 1.3, 1.35, 1.3]]}, margin=0.01)
    """
    pairs = [(s, p) for s, p in zip(phases[SCHEDULED], phases[PLAIN]) if s and p]
    if len(pairs) < 3:
        return None
    cap = 3 * statistics.median([t for pair in pairs for side in pair for t in side])
    ratios = [statistics.fmean(min(t, cap) for t in s) / statistics.fmean(min(t, cap) for t in p) for s, p in pairs]
    mean, error = statistics.fmean(ratios), statistics.stdev(ratios) / math.sqrt(len(ratios))
    if max(ratios) < 1 - margin and 1 - mean > 3 * error:
        return SCHEDULED
    if min(ratios) > 1 + margin and mean - 1 > 3 * error:
        return PLAIN
    return None


def verdict(samples: Dict[str, List[float]], margin: float,
            each_side: bool = False) -> Tuple[str, bool, Tuple[float, float]]:
    """The faster path (ties and differences within the noise: plain), whether its lead is
    larger than the margin and the noise (False: a tie, or samples too noisy), and the
    (scheduled, plain) medians it compared (over pairs of steps, :func:`_paired`).

    The noise is the two sides' standard errors averaged, or with ``each_side`` the larger
    of the two (a re-trial: one side's steps agreeing by chance must not shrink it)."""
    paired = {mode: _paired(samples[mode]) for mode in MODES}
    scheduled, plain = _median(paired[SCHEDULED]), _median(paired[PLAIN])
    errors = (_relative_error(paired[SCHEDULED]), _relative_error(paired[PLAIN]))
    margin = max(margin, 2.5 * (max(errors) if each_side else sum(errors) / 2))
    if scheduled < plain * (1.0 - margin):
        return SCHEDULED, True, (scheduled, plain)
    return PLAIN, plain < scheduled * (1.0 - margin), (scheduled, plain)


def new_chooser(params: Optional[ModeSwitchParams] = None, start_plain: bool = False,
                **adapter: Any) -> ModeChooser:
    """The chooser an adapter's mode switch starts with: ``params`` as given
    (``SchedulerConfig.mode_switch``), else the defaults with the adapter's own changes
    (``adapter``, e.g. ``settle=2``); with ``start_plain`` (a plan's advice) it starts on the
    plain path.

    >>> new_chooser(start_plain=True).mode, new_chooser(settle=2).settle
    ('plain', 2)
    >>> new_chooser(ModeSwitchParams(settle=0), settle=2).settle
    0
    """
    chosen = params if params is not None else replace(ModeSwitchParams(), **adapter)
    return ModeChooser(chosen, start=PLAIN if start_plain else SCHEDULED)


def _paired(values: List[float]) -> List[float]:
    """The means of consecutive pairs of step times (from eight steps on; an odd last one is left out).

    A pipelined path's steps alternate: where one step's communication runs on into the next,
    a long step is followed by a short one. Taken one by one, that spread counts as noise and
    hides a real lead; pairs keep the path's pace and drop the alternation. Where steps vary
    at random, pairs change neither the medians nor their standard error (half as many
    samples, each half as variable). Fewer than eight steps stay single: the spread of two or
    three pairs says little about the noise.

    >>> _paired([1.75, 1.0, 1.25, 1.25, 1.5, 1.0, 1.5, 1.0, 2.0])
    [1.375, 1.25, 1.25, 1.25]
    >>> _paired([1.8, 1.0, 1.3, 1.2])
    [1.8, 1.0, 1.3, 1.2]
    """
    if len(values) < 8:
        return list(values)
    return [(values[i] + values[i + 1]) / 2 for i in range(0, len(values) - 1, 2)]


def _median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _relative_error(values: List[float]) -> float:
    """The standard error of the median of ``values``, relative to it (robust: from the MAD)."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    spread = 1.4826 * statistics.median(abs(v - middle) for v in values)
    return 1.2533 * spread / math.sqrt(len(values)) / middle if middle > 0 else 0.0


class ModeDriver:
    """Runs a :class:`ModeChooser` at the end of every step of an adapter.

    Rank 0 (``leader``) times the steps with ``clock``; at a decision point every rank calls
    ``agree(proposal, veto) -> decision``, a collective of the adapter's (rank 0's proposal,
    or :data:`STOP` if any rank vetoes), and adopts the answer. ``drain()`` is called before
    that collective and before leaving the scheduled path, so nothing of the scheduled path
    is in flight when the ranks agree or switch. A failed agreement (a peer died, or hangs past
    the collective's timeout) raises :class:`~bytescheduler.core.errors.CommunicationError`
    naming ``rank``.

    >>> ticks = iter([0.0, 0.0, 1.0, 1.5, 1.5, 2.0])  # a scheduled step of 1 s, a plain one of 0.5 s
    >>> driver = ModeDriver(ModeChooser(ModeSwitchParams(warmup=1, settle=0, trial=1, pairs=1)), leader=True,
    ...                     agree=lambda proposal, veto: proposal, clock=lambda: next(ticks))
    >>> [driver.end_step(drain=lambda: None) for _ in range(4)]
    ['scheduled', 'plain', 'plain', 'plain']
    """

    def __init__(self, chooser: ModeChooser, leader: bool, agree: Callable[[int, bool], int],
                 clock: Callable[[], float] = time.perf_counter, rank: int = 0,
                 startup: Optional[Any] = None) -> None:
        self.chooser = chooser
        self.startup = startup  # probe() on every rank, predict(step_s) on rank 0 (.startup)
        self._leader = leader
        self._rank = rank
        self._agree = agree
        self._clock = clock
        self._last: Optional[float] = None

    @property
    def mode(self) -> str:
        return self.chooser.mode

    def end_step(self, drain: Callable[[], None], veto: bool = False) -> str:
        """A step ended on this rank: time it (rank 0), agree at a decision point; the mode of the next step."""
        old = self.chooser.mode
        if self._leader:
            now = self._clock()
            self.chooser.record(None if self._last is None else now - self._last)
            self._last = now
        if self.chooser.end_step():
            if old == SCHEDULED:
                drain()
            predict = None
            if self.startup is not None and self.chooser.phase == Phase.WARMUP:
                try:  # collective: every rank probes the link, whatever its veto
                    predict = self.startup.probe()
                except Exception as error:  # noqa: BLE001 - a peer died or hangs: say so
                    raise as_library_error(error, self._rank) from error
            proposal = self.chooser.propose(predict) if self._leader else CONTINUE
            try:
                decision = self._agree(proposal, veto)
            except Exception as error:  # noqa: BLE001 - a peer died or hangs: say so, as every failure
                raise as_library_error(error, self._rank) from error
            self.chooser.adopt(decision)
            if self._leader:
                self._last = self._clock()  # the agreement's wait is no step's time
        if self.chooser.mode != old and old == SCHEDULED:
            drain()
        return self.chooser.mode
