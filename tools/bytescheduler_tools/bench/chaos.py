"""``bytescheduler chaos``: hurt one rank of a 2-rank job at a random moment, see what the other sees.

    bytescheduler chaos --trials 52 --stop-trials 12           # every adapter: the full campaign
    bytescheduler chaos --adapters optimizer --trials 4 --stop-trials 1 --out chaos-results

Each trial starts a 2-rank training job of one adapter on 127.0.0.1
(:mod:`~bytescheduler_tools.bench.jobs`: ``optimizer``, ``hook``, ``horovod``, ``mxnet``) with the
adapter's defaults (the mode switch on) and ``timeout=--timeout``, and hurts rank 1:

- ``kill-forward``, ``kill-backward``, ``kill-step``, ``kill-close``: rank 1 sends itself SIGKILL
  at a random step (``close``: at the end), a random fraction into that phase (a timer thread
  of :mod:`~bytescheduler_tools.bench.rank_loop`; the phase it really landed in is recorded). The
  ``--trials`` kill trials of an adapter take the four phases in turn.
- ``stop``: rank 1 sends itself SIGSTOP at a random moment of forward, backward or step and
  stays stopped past the timeout: until rank 0 reported its outcome, or ``--timeout`` +
  ``--margin`` seconds, after which the tool sends it SIGCONT and watches what it does.

For each trial it records (:func:`judge`):

- **clear error**: rank 0 raised a bytescheduler ``CommunicationError`` (or a subclass such as
  ``CommunicationTimeout``), or ``RankFailed`` (with the hook: DDP's RuntimeError naming one,
  which is how DDP passes on what a hook raised), at most ``--timeout`` + ``--margin`` seconds
  after the fault, and how long it took. Also accepted, and counted apart: rank 0 finished
  cleanly when the fault came after rank 1's last communication (in the last step's
  ``step()``, or in ``close()``); for MXNet, the
  launcher stopped rank 0 (SIGTERM) within that time because rank 1 exited non-zero, which
  is what ``bytescheduler mxnet-launch`` documents, before rank 0 could raise.
- **all exited**: every process of the job ended by itself (no process of the job, whatever
  its session, still running when the tool ended the trial; Horovod's rendezvous server
  alone is stopped by the tool, as horovodrun stops it).
- **ports freed**: no socket listens any more on a port the job's processes listened on
  (``/proc/net/tcp``).

Writes ``chaos.json`` (every trial: its plan, what each rank reported, exit codes, times,
ports, verdict) into ``--out``, prints a markdown table per adapter and case, and exits 1
when a trial failed any of the three. ``--seed`` makes the plans repeatable.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from .jobs import ADAPTERS, POLL_SECONDS, REFERENCES, Job, default_mxnet_python, sigterm_unwinds, wait_until_closed
from .procstats import alive
from .rank_loop import DUMP_SIGNAL, read_report

KILL_PHASES = ("forward", "backward", "step", "close")
STOP_PHASES = ("forward", "backward", "step")
CASES = tuple(f"kill-{phase}" for phase in KILL_PHASES) + ("stop",)
SURVIVOR, VICTIM = 0, 1
LAUNCHER = "bytescheduler mxnet-launch: "  # how the MXNet launcher's own messages begin


@dataclass
class Plan:
    """One trial's fault: which, where (phase, step, fraction into the phase)."""

    adapter: str
    case: str
    phase: str
    step: int
    fraction: float

    @property
    def fault(self) -> str:
        return "stop" if self.case == "stop" else "kill"

    def options(self) -> List[str]:
        return ["--fault", self.fault, "--fault-rank", str(VICTIM), "--fault-phase", self.phase,
                "--fault-step", str(self.step), "--fault-fraction", f"{self.fraction:.4f}"]


def plan_trials(adapter: str, kills: int, stops: int, steps: int, rng: random.Random,
                fault_steps: Optional[range] = None) -> List[Plan]:
    """``kills`` kill trials (the phases in turn) and ``stops`` stop trials, at random moments:
    a step of ``fault_steps`` (default: any of the ``steps``), a random fraction into the phase.

    >>> [(p.case, p.step) for p in plan_trials("hook", 5, 1, 24, random.Random(0), range(2, 3))]
    [('kill-forward', 2), ('kill-backward', 2), ('kill-step', 2), ('kill-close', 24), ('kill-forward', 2), ('stop', 2)]
    """
    fault_steps = fault_steps if fault_steps is not None else range(steps)
    plans = []
    for index in range(kills):
        phase = KILL_PHASES[index % len(KILL_PHASES)]
        step = steps if phase == "close" else rng.choice(fault_steps)
        plans.append(Plan(adapter, f"kill-{phase}", phase, step, rng.random()))
    for _ in range(stops):
        plans.append(Plan(adapter, "stop", rng.choice(STOP_PHASES), rng.choice(fault_steps), rng.random()))
    return plans


class Trial:
    """Runs one :class:`Plan`'s job and watches it until every process ended or time is up."""

    def __init__(self, plan: Plan, args: argparse.Namespace, job_dir: str) -> None:
        self.plan, self.args = plan, args
        options = ["--steps", str(args.steps), "--model", args.model, "--batch-size", str(args.batch_size),
                   "--timeout", f"{args.timeout:g}"] + plan.options()
        python = args.mxnet_python if plan.adapter == "mxnet" else sys.executable
        self.job = Job(plan.adapter, options, job_dir, deadline=args.startup, python=python)
        self.events: Dict[int, List[dict]] = {SURVIVOR: [], VICTIM: []}
        self.rank_pids: Dict[int, int] = {}
        self.gone_at: Dict[int, float] = {}  # rank -> when its process was first seen gone
        self.continued_at: Optional[float] = None

    def first(self, rank: int, *kinds: str) -> Optional[dict]:
        return next((event for event in self.events[rank] if event["event"] in kinds), None)

    def _look(self) -> None:
        self.job.poll()
        now = time.time()
        for rank in (SURVIVOR, VICTIM):
            self.events[rank] = read_report(self.job.report_path(rank))
            start = self.first(rank, "start")
            if start is not None:
                self.rank_pids[rank] = start["pid"]
        if SURVIVOR not in self.rank_pids and VICTIM in self.rank_pids:
            # An MXNet worker learns its rank from the store: one hurt early may be gone
            # before the other knows its rank. The other is the launcher's other worker.
            others = set(self._launched_workers()) - {self.rank_pids[VICTIM]}
            if len(others) == 1:
                self.rank_pids[SURVIVOR] = others.pop()
        for rank, pid in self.rank_pids.items():
            if rank not in self.gone_at and not alive(pid):
                self.gone_at[rank] = now

    def _limit(self) -> float:
        """When the tool stops waiting: the start-up budget until the fault; then the timeout,
        the margin and the exit grace after it, and at least the exit grace after a SIGCONT."""
        fault = self.first(VICTIM, "fault")
        if fault is None:
            return self.job.started + self.args.startup
        limit = fault["time"] + self.args.timeout + self.args.margin + self.args.exit_grace
        if self.continued_at is not None:
            limit = max(limit, self.continued_at + self.args.exit_grace)
        return limit

    def _maybe_continue(self) -> None:
        fault = self.first(VICTIM, "fault")
        if self.plan.fault != "stop" or fault is None or self.continued_at is not None:
            return
        outcome = self.first(SURVIVOR, "error", "done") or (SURVIVOR in self.gone_at)
        if outcome or time.time() > fault["time"] + self.args.timeout + self.args.margin:
            pid = self.rank_pids.get(VICTIM)
            self.continued_at = time.time()
            if pid is not None:
                self.job.signal(pid, signal.SIGCONT)

    def run(self) -> dict:
        """Run the trial; its record (see :func:`judge` for the verdict)."""
        left: List[str] = []
        try:
            self.job.start()
            while True:
                self._look()
                self._maybe_continue()
                if self.job.finished() or time.time() > self._limit():
                    break
                time.sleep(POLL_SECONDS)
        finally:
            self._dump_stacks()
            helpers = [process.name for process in self.job.processes if process.helper]
            left = [name for name in self.job.kill() if name not in helpers]
        self._look()
        exits = [process.exited_at for process in self.job.processes if not process.helper]
        listening = set(self.job.ports)
        ports_left = wait_until_closed(listening)
        return {
            "plan": asdict(self.plan),
            "steps": self.args.steps,
            "fault": self.first(VICTIM, "fault"),
            "survivor": self.first(SURVIVOR, "error", "done"),
            "victim_after": self.first(VICTIM, "error", "done") if self.plan.fault == "stop" else None,
            "continued_at": self.continued_at,
            "gone_at": {str(rank): when for rank, when in self.gone_at.items()},
            "exit_codes": self.job.exit_codes(),
            "all_gone_at": None if left or None in exits else max(exits),
            "launcher_stopped_job": self._launcher_stopped(),
            "left_running": left,
            "ports": sorted(listening),
            "ports_left": sorted(ports_left),
            "started": self.job.started,
        }

    def _dump_stacks(self) -> None:
        """Ranks still running when the tool gives up write their threads' stacks to their
        logs (where they were blocked) before the kill."""
        running = [pid for pid in self.rank_pids.values() if alive(pid) and self.job.signal(pid, DUMP_SIGNAL)]
        if running:
            time.sleep(1.0)

    def _launcher_says(self) -> List[str]:
        """MXNet: the lines of the launcher's own messages."""
        if self.plan.adapter != "mxnet":
            return []
        try:
            with open(os.path.join(self.job.job_dir, "launcher.log")) as handle:
                return [line for line in handle if line.startswith(LAUNCHER)]
        except OSError:
            return []

    def _launched_workers(self) -> List[int]:
        """MXNet: the workers' pids, from the launcher's "started ..." line."""
        started = next((line for line in self._launcher_says() if ": started " in line), "")
        return [int(pid) for pid in re.findall(r"worker \d+ \(pid (\d+)\)", started)]

    def _launcher_stopped(self) -> bool:
        """MXNet: the launcher said it stopped the remaining processes."""
        return any(line.startswith(LAUNCHER + "stopping ") for line in self._launcher_says())


def _reaction(record: dict) -> Tuple[Optional[str], Optional[float], str]:
    """What rank 0 did about the fault, when, and a short name for it: it raised (``error``),
    it finished (``done``), the launcher stopped it (``stopped``, MXNet), or nothing (None)."""
    survivor = record["survivor"]
    if survivor is not None and survivor["event"] == "error":
        return "error", survivor["time"], survivor["type"]
    if survivor is not None:
        return "done", survivor["time"], "finished"
    if record["launcher_stopped_job"] and str(SURVIVOR) in record["gone_at"]:
        return "stopped", record["gone_at"][str(SURVIVOR)], "stopped by the launcher"
    return None, None, ""


def judge(record: dict, timeout: float, margin: float) -> dict:
    """The verdict of one trial's record: outcome, seconds to it, all exited, ports freed, ok.

    >>> record = {"plan": {"adapter": "optimizer", "case": "kill-step"}, "steps": 24,
    ...           "fault": {"time": 10.0, "landed": "step", "landed_step": 7},
    ...           "survivor": {"event": "error", "clear": True, "type": "CommunicationError", "time": 10.4},
    ...           "gone_at": {"0": 10.9}, "left_running": [], "ports_left": [], "launcher_stopped_job": False,
    ...           "all_gone_at": 10.9, "continued_at": None}
    >>> verdict = judge(record, timeout=8, margin=5)
    >>> verdict["outcome"], round(verdict["seconds"], 1), verdict["ok"]
    ('clear error', 0.4, True)
    >>> judge(dict(record, survivor=None, gone_at={}, left_running=["rank0"]), 8, 5)["outcome"]
    'no outcome (hang)'
    >>> judge(dict(record, continued_at=19.0, survivor=dict(record["survivor"], time=19.5)), 8, 5)["outcome"]
    'blocked until rank 1 ran again, then CommunicationError'
    """
    fault, survivor = record["fault"], record["survivor"]
    bound = timeout + margin
    kind, when, name = _reaction(record)
    continued = record.get("continued_at")
    verdict = {"bound": bound, "seconds": None if fault is None or when is None else when - fault["time"]}
    if fault is None:
        verdict.update(outcome="no fault happened", reaction_ok=False)
    elif kind is None:
        verdict.update(outcome="no outcome (hang)" if record["left_running"] else "exited without a report",
                       reaction_ok=False)
    elif continued is not None and when > continued:
        # Rank 0 noticed nothing while rank 1 was stopped: it went on only once rank 1 did.
        verdict.update(outcome=f"blocked until rank 1 ran again, then {name}", reaction_ok=False)
    elif kind == "error":
        if not survivor["clear"]:
            verdict["outcome"] = f"other error ({name})"
        else:
            verdict["outcome"] = "clear error" if verdict["seconds"] <= bound else "clear error, late"
        verdict["reaction_ok"] = verdict["outcome"] == "clear error"
    elif kind == "done":
        # Rank 0 needed nothing more of rank 1: possible only once rank 1 had done its last
        # communication, in the last step's step() at the earliest.
        last_step = fault["landed"] == "step" and fault["landed_step"] == record["steps"] - 1
        verdict.update(outcome=name, reaction_ok=last_step or fault["landed"] in ("close", "after-close"))
    else:
        verdict.update(outcome=name, reaction_ok=verdict["seconds"] <= bound)
    verdict["all_exited"] = not record["left_running"]
    verdict["exit_seconds"] = (None if fault is None or record["all_gone_at"] is None
                               else record["all_gone_at"] - fault["time"])
    verdict["ports_freed"] = not record["ports_left"]
    verdict["ok"] = verdict["reaction_ok"] and verdict["all_exited"] and verdict["ports_freed"]
    return verdict


def summarize(records: List[dict]) -> List[dict]:
    """One row per adapter and case: where the faults landed and on which path of the mode
    switch, counts of outcomes, the slowest reaction and exit, exits, ports."""
    rows: Dict[tuple, dict] = {}
    for record in records:
        plan, verdict = record["plan"], record["verdict"]
        row = rows.setdefault((plan["adapter"], plan["case"]), {
            "adapter": plan["adapter"], "case": plan["case"], "trials": 0, "outcomes": {}, "landed": {}, "modes": {},
            "max_seconds": None, "max_exit_seconds": None, "all_exited": 0, "ports_freed": 0, "ok": 0, "victim_after": {}})
        row["trials"] += 1
        row["outcomes"][verdict["outcome"]] = row["outcomes"].get(verdict["outcome"], 0) + 1
        if record["fault"] is not None:
            landed, mode = record["fault"]["landed"], record["fault"]["mode"] or "fixed"
            row["landed"][landed] = row["landed"].get(landed, 0) + 1
            row["modes"][mode] = row["modes"].get(mode, 0) + 1
        if verdict["seconds"] is not None:
            row["max_seconds"] = max(row["max_seconds"] or 0.0, verdict["seconds"])
        if verdict["exit_seconds"] is not None:
            row["max_exit_seconds"] = max(row["max_exit_seconds"] or 0.0, verdict["exit_seconds"])
        row["all_exited"] += verdict["all_exited"]
        row["ports_freed"] += verdict["ports_freed"]
        row["ok"] += verdict["ok"]
        if plan["case"] == "stop":
            after = record["victim_after"]
            key = "no report" if after is None else (after["type"] if after["event"] == "error" else "finished")
            row["victim_after"][key] = row["victim_after"].get(key, 0) + 1
    return [rows[key] for key in sorted(rows, key=lambda k: ((ADAPTERS + REFERENCES).index(k[0]), CASES.index(k[1])))]


def _counts(counts: Dict[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(counts.items(), key=lambda item: -item[1]))


def table(rows: List[dict]) -> str:
    lines = ["| adapter | case | trials | landed in | path then | rank 0's outcome | max s to it | all exited | max s to exit "
             "| ports freed | ok | rank 1 after SIGCONT |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        seconds, exit_seconds = (("" if value is None else f"{value:.2f}")
                                 for value in (row["max_seconds"], row["max_exit_seconds"]))
        lines.append(f"| {row['adapter']} | {row['case']} | {row['trials']} | {_counts(row['landed'])} | "
                     f"{_counts(row['modes'])} | "
                     f"{_counts(row['outcomes'])} | {seconds} | {row['all_exited']}/{row['trials']} | {exit_seconds} | "
                     f"{row['ports_freed']}/{row['trials']} | {row['ok']}/{row['trials']} | "
                     f"{_counts(row['victim_after'])} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bytescheduler chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", nargs="+", choices=ADAPTERS + REFERENCES, default=list(ADAPTERS),
                        help="default: every adapter; ddp (plain DDP, no bytescheduler) runs as a reference when named")
    parser.add_argument("--trials", type=int, default=8, help="kill trials per adapter, the four phases in turn")
    parser.add_argument("--stop-trials", type=int, default=2, help="SIGSTOP trials per adapter")
    parser.add_argument("--timeout", type=float, default=8.0, help="the adapters' timeout=, seconds (default 8)")
    parser.add_argument("--margin", type=float, default=5.0,
                        help="seconds past the timeout still counted as in time (default 5)")
    parser.add_argument("--exit-grace", type=float, default=30.0,
                        help="seconds the processes get to exit after the timeout and margin (default 30)")
    parser.add_argument("--startup", type=float, default=120.0,
                        help="seconds a job may take to reach its fault before it is killed (default 120)")
    parser.add_argument("--steps", type=int, default=24, help="training steps of each job (default 24)")
    parser.add_argument("--fault-steps", type=int, nargs=2, metavar=("FIRST", "END"), default=None,
                        help="draw the faults' steps from FIRST to END-1 (default: any step); e.g. 0 3 keeps "
                        "them in the mode switch's warm-up, which always schedules")
    parser.add_argument("--model", default="cnn-small", help="a model of bench/models.py (and mxnet_models.py)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=None, help="seed of the trials' random plans (default: random)")
    parser.add_argument("--mxnet-python", default=default_mxnet_python(),
                        help="interpreter with MXNet and bytescheduler (default: $BYTESCHEDULER_MXNET_PYTHON, "
                        "else this one if it has MXNet, else this checkout's .venv-mxnet/bin/python)")
    parser.add_argument("--out", default="chaos-results", help="folder for chaos.json")
    parser.add_argument("--keep-logs", action="store_true", help="keep every trial's logs (default: failed ones)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if "mxnet" in args.adapters and not args.mxnet_python:
        parser.error("the mxnet adapter needs --mxnet-python (or $BYTESCHEDULER_MXNET_PYTHON, or .venv-mxnet)")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(args.seed)
    fault_steps = None
    if args.fault_steps is not None:
        fault_steps = range(*args.fault_steps)
        if not fault_steps or fault_steps.start < 0 or fault_steps.stop > args.steps:
            parser.error(f"--fault-steps must be a non-empty range within the {args.steps} steps")
    plans = [plan for adapter in args.adapters
             for plan in plan_trials(adapter, args.trials, args.stop_trials, args.steps, rng, fault_steps)]
    os.makedirs(args.out, exist_ok=True)
    logs = os.path.join(os.path.abspath(args.out), "logs")
    records = []
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="bytescheduler-chaos-") as work_dir:
        for index, plan in enumerate(plans):
            trial = Trial(plan, args, os.path.join(work_dir, f"trial{index:03d}-{plan.adapter}-{plan.case}"))
            record = trial.run()
            record["verdict"] = judge(record, args.timeout, args.margin)
            records.append(record)
            keep = args.keep_logs or not record["verdict"]["ok"]
            record["log_dir"] = trial.job.keep_logs(logs) if keep else None
            _progress(index, len(plans), record)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    rows = summarize(records)
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    with open(os.path.join(args.out, "chaos.json"), "w") as handle:
        json.dump({"settings": settings, "cpu_seconds": cpu, "summary": rows, "trials": records}, handle, indent=1)
    print(table(rows))
    print(f"seed {args.seed}; timeout {args.timeout:g} s, in time: within {args.timeout + args.margin:g} s of the "
          f"fault; {cpu:.0f} CPU-seconds; {os.path.abspath(args.out)}/chaos.json", file=sys.stderr)
    return 0 if all(record["verdict"]["ok"] for record in records) else 1


def _progress(index: int, total: int, record: dict) -> None:
    plan, verdict, fault = record["plan"], record["verdict"], record["fault"]
    landed = "no fault" if fault is None else f"landed in {fault['landed']} of step {fault['landed_step']}"
    seconds = "" if verdict["seconds"] is None else f" after {verdict['seconds']:.2f} s"
    problems = [] if verdict["all_exited"] else [f"left running: {', '.join(record['left_running'])}"]
    if not verdict["ports_freed"]:
        problems.append(f"ports still listening: {record['ports_left']}")
    print(f"  [{index + 1}/{total}] {plan['adapter']} {plan['case']} ({landed}): {verdict['outcome']}{seconds}"
          + "".join(f"; {problem}" for problem in problems) + ("" if verdict["ok"] else "  FAILED"),
          file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
