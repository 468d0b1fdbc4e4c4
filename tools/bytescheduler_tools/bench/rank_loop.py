"""The training loop of one rank of a soak or chaos job, whatever its framework (imports none of them).

A framework's trainee (:mod:`~bytescheduler_tools.bench.torch_trainee`,
:mod:`~bytescheduler_tools.bench.mxnet_trainee`) builds the model, the optimizer and the adapter;
:func:`run` drives it for ``--steps`` steps of forward, backward and ``step()``, then
``close()``, and writes what happened as JSON lines to the rank's report file
(``--report``, ``{rank}`` replaced), one object per event:

- ``start``: the rank is ready (``pid``, ``time``);
- ``sample`` every ``--sample-every`` steps: RSS, threads, open descriptors and sockets,
  malloc's bytes in use and free and its arenas (:mod:`~bytescheduler_tools.bench.procstats`),
  the adapter's mode (``scheduled``/``plain``),
  ``step`` the number of steps done;
  ``closed``: the same after ``close()``;
- ``fault``: the rank is about to SIGKILL or SIGSTOP itself: the planned phase, the phase
  it is in at that instant (``landed``), ``time``; ``continued``: it was stopped and runs again;
- ``error``: training raised: its type, whether it is a clear bytescheduler error
  (a ``CommunicationError``, its subclasses such as ``CommunicationTimeout``, or ``RankFailed``;
  also as DDP wraps one raised in the hook: a RuntimeError naming it, ``wrapped``), the
  message, the step, phase and mode, ``time``;
  then ``abandoned`` once ``close(wait=False)`` returned (``error``: what it raised, if anything);
- ``done``: every step and ``close()`` returned (``seconds`` of the loop, ``modes``: how
  many steps ended on each path of the mode switch).

A fault hits the rank of ``--fault-rank``: at step ``--fault-step``, entering phase
``--fault-phase`` (forward, backward, step or close), it starts a timer of
``--fault-fraction`` times that phase's median duration on the earlier steps (``close``,
which runs once, uses the ``step`` phase's), and when the timer fires, the rank sends itself
SIGKILL (``--fault kill``) or SIGSTOP (``--fault stop``), wherever it is by then. A timer that
has not fired when ``close()`` returns fires after it (``landed`` is then ``after-close``).
Times are ``time.time()``, so the ranks' records compare on one machine.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import signal
import statistics
import threading
import time
from typing import Callable, Dict, List, Optional, Protocol

from bytescheduler.core import errors
from .procstats import allocator, resources

PHASES = ("forward", "backward", "step", "close")
FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
# Our errors that say a peer or the communication failed (any subclass counts, such as
# CommunicationTimeout); RankFailed is looked up by name, as older versions lack it.
CLEAR_ERRORS = tuple(getattr(errors, name) for name in ("CommunicationError", "RankFailed") if hasattr(errors, name))
# DDP runs a communication hook's future callbacks in C++ and raises what they raised as a
# RuntimeError that names it: "Got the following error when running the callback: <Type>: ...".
_CALLBACK_ERROR = re.compile(r"error when running the callback: (\w+):")
EXIT_ERROR = 3  # a rank that caught an error in training exits with this status
# The tools send it to a rank that is still running when they give up on it, before the kill.
DUMP_SIGNAL = signal.SIGUSR1


class Trainee(Protocol):
    """What a framework gives the loop: one rank's model, optimizer and adapter."""

    rank: int

    def forward(self) -> None: ...

    def backward(self) -> None: ...

    def step(self) -> None: ...

    def close(self) -> None: ...

    def abandon(self) -> None:
        """After an error: stop the adapter without waiting for pending work (``close(wait=False)``)."""

    def mode(self) -> Optional[str]: ...


def dump_stacks_on_signal() -> None:
    """From now on :data:`DUMP_SIGNAL` writes every thread's Python stack to stderr (the
    rank's log): where a rank that never returned was blocked, even inside a C++ call that
    holds the interpreter lock (:mod:`faulthandler` needs no lock). Trainees call it first.

    >>> dump_stacks_on_signal()   # doctest: +SKIP
    """
    faulthandler.register(DUMP_SIGNAL, all_threads=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every trainee takes (the tools pass them)."""
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--report", required=True, help="JSON-lines file of this rank; {rank} is replaced")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=None,
                        help="the adapter's timeout= (default: the library's, or BYTESCHEDULER_TIMEOUT)")
    parser.add_argument("--sample-every", type=int, default=0, help="sample resources every N steps (0: never)")
    parser.add_argument("--fault", choices=sorted(FAULTS), default=None)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=None)
    parser.add_argument("--fault-phase", choices=PHASES, default=None)
    parser.add_argument("--fault-fraction", type=float, default=0.5,
                        help="where in the phase: this fraction of its median duration")


class Reporter:
    """Appends one JSON object per line to the rank's report file, flushed at once (a SIGKILL
    loses nothing written before it)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def write(self, event: str, **values) -> None:
        values.update(event=event, time=values.get("time", time.time()))
        line = (json.dumps(values, sort_keys=True) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)


def read_report(path: str) -> List[dict]:
    """The events of a report file (a last line cut short by a kill is left out)."""
    events = []
    try:
        with open(path) as handle:
            for line in handle:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return events


class Saboteur:
    """A timer thread that sends this process ``sig`` after ``delay`` seconds, recording where
    the training thread was at that instant (``where()``)."""

    def __init__(self, sig: int, delay: float, where: Callable[[], Dict], reporter: Reporter, planned: Dict) -> None:
        self._sig, self._delay, self._where = sig, delay, where
        self._reporter, self._planned = reporter, planned
        self._thread = threading.Thread(target=self._run, name="chaos-saboteur", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait(self) -> None:
        """Wait until it has fired (a SIGKILL never returns from here)."""
        self._thread.join()

    def _run(self) -> None:
        time.sleep(self._delay)
        landed = self._where()
        self._reporter.write("fault", signal=signal.Signals(self._sig).name, landed=landed["phase"],
                             landed_step=landed["step"], mode=landed["mode"], delay=self._delay, **self._planned)
        os.kill(os.getpid(), self._sig)
        self._reporter.write("continued")  # SIGSTOP only: someone sent SIGCONT


def named_error(error: BaseException) -> Optional[str]:
    """The type of the error DDP wrapped in ``error`` (a RuntimeError raised by a hook's future), if any."""
    match = _CALLBACK_ERROR.search(str(error))
    return match.group(1) if match else None


def clear_error(error: BaseException) -> bool:
    """True for a bytescheduler error that names a failed peer or communication, raised as
    itself or wrapped by DDP (the hook's documented way to reach ``backward()``)."""
    if isinstance(error, CLEAR_ERRORS):
        return True
    kind = getattr(errors, named_error(error) or "", None)
    return isinstance(kind, type) and issubclass(kind, CLEAR_ERRORS)


class Loop:
    """One rank's run: the phases, their durations, the samples and the planned fault."""

    def __init__(self, trainee: Trainee, args: argparse.Namespace) -> None:
        self.trainee, self.args = trainee, args
        self.reporter = Reporter(args.report.replace("{rank}", str(trainee.rank)))
        self.phase, self.step_index = "start", 0
        self.durations: Dict[str, List[float]] = {phase: [] for phase in PHASES}
        victim = args.fault is not None and trainee.rank == args.fault_rank
        self.fault_step = args.fault_step if victim else None
        self.saboteur: Optional[Saboteur] = None
        self.steps_done = 0
        self.mode_steps: Dict[str, int] = {}  # steps per path of the mode switch ("fixed": no switch)

    def where(self) -> Dict:
        return {"phase": self.phase, "step": self.step_index, "mode": self.trainee.mode()}

    def _enter(self, phase: str) -> None:
        self.phase = phase
        if self.step_index == self.fault_step and phase == self.args.fault_phase and self.saboteur is None:
            basis = self.durations["step" if phase == "close" else phase]
            typical = statistics.median(basis[-20:]) if basis else 0.001
            planned = {"phase": phase, "step": self.step_index, "fraction": self.args.fault_fraction}
            self.saboteur = Saboteur(FAULTS[self.args.fault], self.args.fault_fraction * typical, self.where,
                                     self.reporter, planned)
            self.saboteur.start()

    def _timed(self, phase: str, action: Callable[[], None]) -> None:
        self._enter(phase)
        started = time.perf_counter()
        action()
        self.durations[phase].append(time.perf_counter() - started)

    def _abandon(self) -> None:
        try:
            self.trainee.abandon()
        except Exception as error:  # noqa: BLE001 - the first error is the result; note this one
            self.reporter.write("abandoned", error=f"{type(error).__name__}: {error}"[:500])
            return
        self.reporter.write("abandoned", error=None)

    def sample(self, event: str = "sample") -> None:
        """Write what this process holds now; ``step`` counts the steps done."""
        self.reporter.write(event, step=self.steps_done, mode=self.trainee.mode(), **resources().as_dict(),
                            **allocator())

    def run(self) -> int:
        """Train, close, report; 0 when everything returned, :data:`EXIT_ERROR` when training raised."""
        args, trainee = self.args, self.trainee
        self.reporter.write("start", pid=os.getpid(), rank=trainee.rank)
        started = time.time()
        try:
            for self.step_index in range(args.steps):
                self._timed("forward", trainee.forward)
                self._timed("backward", trainee.backward)
                self._timed("step", trainee.step)
                self.steps_done += 1
                mode = trainee.mode() or "fixed"
                self.mode_steps[mode] = self.mode_steps.get(mode, 0) + 1
                if args.sample_every and self.steps_done % args.sample_every == 0:
                    self.sample()
            self.step_index = args.steps
            self._timed("close", trainee.close)
        except Exception as error:  # noqa: BLE001 - what was raised is the result
            self.reporter.write("error", type=type(error).__name__, module=type(error).__module__,
                                clear=clear_error(error), wrapped=named_error(error), message=str(error)[:2000],
                                **self.where())
            self._abandon()
            return EXIT_ERROR
        self.phase = "after-close"
        if args.sample_every:
            self.sample("closed")
        self.reporter.write("done", steps=args.steps, seconds=time.time() - started, modes=self.mode_steps)
        if self.saboteur is not None:
            self.saboteur.wait()  # the fault comes after close(): it still comes
        return 0


def run(trainee: Trainee, args: argparse.Namespace) -> int:
    """Run :class:`Loop` for ``trainee``; the rank's exit status."""
    return Loop(trainee, args).run()
