"""``bytescheduler bench``: measure every system on a (bandwidth-limited) 2-rank testbed.

    bytescheduler bench --quick                       # the demo: 1 Gbit/s where it can shape a link, then loopback
    bytescheduler bench --bandwidth 1gbit --model vgg --rounds 10 --iters 3
    bytescheduler bench --bandwidth 2gbit --systems hvd hvd-scheduled mxnet mxnet-scheduled --out results/2gbit

Writes ``results.json``, ``results.md``, ``speed.png`` and one ``timeline-<system>.png``
per system into ``--out`` and prints the markdown table.

Systems run as jobs of 2 ranks (one per namespace of the testbed):

- torch.distributed (gloo): compute, comm, ddp, ddp-hook, scheduled, alternating in one job;
- Horovod (gloo): hvd, hvd-scheduled, alternating in a second job, started without horovodrun
  (which cannot place ranks in namespaces): a rendezvous server in rank 0's namespace and
  the ``HOROVOD_*`` variables horovodrun would set;
- MXNet (ps-lite, ``dist_sync``, with ``--mxnet-python``): mxnet, mxnet-scheduled. One process
  cannot hold two ``dist_sync`` stores, so each system is a job of its own (scheduler in rank
  0's namespace, one server and one worker per namespace); the jobs stay alive together and
  take turns: each one's warm-up, then round by round a block of each.

In every job the systems' order alternates from round to round (A B, B A, ...).

By default every system whose framework is available runs; the output says which were
left out and why. A failing process (or the deadline) stops its job at once and shows
the logs; the namespaces are always torn down (also on Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .common import round_order, touch
from .models import MODELS
from .report import merge, report
from bytescheduler.launcher import free_port, with_engine_env
from .testbed import NamespaceTestbed, Testbed, make_testbed, pin_cores

TORCH_SYSTEMS = ("compute", "comm", "ddp", "ddp-hook", "ddp-torch-hook", "ddp-fused", "ddp-again", "scheduled")
HOROVOD_SYSTEMS = ("hvd", "hvd-scheduled", "hvd-again")
MXNET_SYSTEMS = ("mxnet", "mxnet-scheduled", "mxnet-again")
SYSTEMS = TORCH_SYSTEMS + HOROVOD_SYSTEMS + MXNET_SYSTEMS
# Only when asked for: DDP with PyTorch's own Python all-reduce hook, what any comm hook
# costs; and the A/A controls, a second copy of a baseline timed against the first, which
# show how far apart the bench puts two identical systems on this machine.
ON_REQUEST = ("ddp-torch-hook", "ddp-again", "hvd-again", "mxnet-again")
DEFAULT_SYSTEMS = [name for name in SYSTEMS if name not in ON_REQUEST]
QUICK_SYSTEMS = ["compute", "ddp", "ddp-hook", "scheduled"]
# The demo's first part, where a link can be shaped: a model with something to win at 1 Gbit/s
# (vgg-small: 21 MiB of gradients against 0.1 s of compute per step), after 20 warm-up steps,
# within which the mode switch makes its first choice. About a minute.
QUICK_SHAPED = ["--bandwidth", "1gbit", "--model", "vgg-small", "--systems", *QUICK_SYSTEMS,
                "--blocks", "4", "--iters", "10", "--warmup", "20"]
WORLD = 2
ENV_MXNET_PYTHON = "BYTESCHEDULER_MXNET_PYTHON"
# What each job's large all-reduce (or push+pull) measures the link with, in the report.
LINKS = {"torch": "gloo all-reduce", "horovod": "Horovod all-reduce", "mxnet": "ps-lite push+pull"}
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tools/bytescheduler_tools/bench/


class JobFailed(RuntimeError):
    def __init__(self, message: str, log_dir: str) -> None:
        super().__init__(message)
        self.log_dir = log_dir


@dataclass
class Process:
    name: str
    command: List[str]
    env: Dict[str, str]
    helper: bool = False  # serves the others until the job is over (then killed); exiting early is a failure


class RunningJob:
    """One job's processes, started each in a session of its own: :meth:`poll` follows the first
    one's output (``PROGRESS`` lines as a bar) and fails fast; :meth:`stop` kills whatever is left."""

    def __init__(self, label: str, processes: List[Process], log_dir: str, show_progress: bool = True) -> None:
        self.label, self.processes, self.log_dir, self.show_progress = label, processes, log_dir, show_progress
        self.popens: List[subprocess.Popen] = []
        self._logs = []
        self._buffered = ""
        try:
            for index, process in enumerate(processes):
                log = open(os.path.join(log_dir, f"{process.name}.log"), "w")
                self._logs.append(log)
                self.popens.append(subprocess.Popen(
                    process.command, env=process.env, start_new_session=True, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if index == 0 else log, stderr=log,
                ))
            os.set_blocking(self.popens[0].stdout.fileno(), False)
        except BaseException:
            self.stop()
            raise

    def poll(self, end: float) -> bool:
        """True once every process but the helpers exited with 0; raises :class:`JobFailed` when
        one failed (or a helper exited) or past ``end``."""
        try:
            self._buffered += os.read(self.popens[0].stdout.fileno(), 65536).decode(errors="replace")
        except BlockingIOError:
            pass
        *lines, self._buffered = self._buffered.split("\n")
        for line in lines:
            if line.startswith("PROGRESS "):
                if self.show_progress:
                    _progress(self.label, *(int(x) for x in line.split()[1].split("/")))
            elif line.strip():
                print(line, file=sys.stderr)
        codes = [popen.poll() for popen in self.popens]
        failed = [f"{process.name} exited with {code}" for process, code in zip(self.processes, codes)
                  if code is not None and (code != 0 or process.helper)]
        if failed:
            raise JobFailed(f"{self.label} job failed: {', '.join(failed)}; see the logs", self.log_dir)
        if all(code == 0 for process, code in zip(self.processes, codes) if not process.helper):
            return True
        if time.monotonic() > end:
            raise JobFailed(f"{self.label} job failed: not finished within the deadline", self.log_dir)
        return False

    def stop(self) -> None:
        for popen in self.popens:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(10)
        for log in self._logs:
            log.close()


def run_processes(label: str, processes: List[Process], log_dir: str, end: float,
                  show_progress: bool = True) -> None:
    """Run one job to its end (see :class:`RunningJob`); whatever happens, nothing is left running."""
    job = RunningJob(label, processes, log_dir, show_progress)
    try:
        while not job.poll(end):
            time.sleep(0.2)
    finally:
        job.stop()


def _progress(label: str, done: int, total: int) -> None:
    bar = "#" * (30 * done // total)
    print(f"\r  {label:<8} rounds [{bar:<30}] {done}/{total}", end="\n" if done == total else "",
          file=sys.stderr, flush=True)


def _worker_options(args: argparse.Namespace, systems: List[str], job_dir: str, rounds: int,
                    trace: bool = True, link: bool = True) -> List[str]:
    """The options every worker module takes (see :func:`bytescheduler_tools.bench.common.add_arguments`)."""
    options = [
        "--model", args.model, "--batch-size", str(args.batch_size), "--systems", *systems,
        "--warmup", str(args.warmup), "--iters", str(args.iters), "--rounds", str(rounds),
        "--lead-in", str(args.lead_in),
        *(["--from-start"] if getattr(args, "from_start", False) else []),
        "--trace-dir", args.trace_dir, "--output", os.path.join(job_dir, "rank{rank}.json"),
    ]
    if args.partition:
        options += ["--partition", args.partition]
    if args.credit:
        options += ["--credit", args.credit]
    if args.auto_tune:
        options += ["--auto-tune", str(args.auto_tune)]
    if not trace:
        options.append("--no-trace")
    if not link:
        options.append("--no-link")
    return options


def _job_dir(work_dir: str, name: str) -> str:
    path = os.path.join(work_dir, name)
    os.makedirs(path)
    return path


def _read_results(job_dir: str) -> List[dict]:
    results = []
    for rank in range(WORLD):
        with open(os.path.join(job_dir, f"rank{rank}.json")) as handle:
            results.append(json.load(handle))
    return results


def torch_ranks(testbed: Testbed, module: str, options: List[str]) -> List[Process]:
    """One process per rank running ``python -m module --backend gloo --rank R ... options``,
    joined by torch.distributed (gloo) through rank 0's address."""
    port = free_port()  # free on the host; namespaces start with every port free
    processes = []
    for rank in range(WORLD):
        command = [sys.executable, "-m", module, "--backend", "gloo", "--rank", str(rank),
                   "--world-size", str(WORLD), "--master", testbed.master_addr, "--port", str(port), *options]
        env = dict(os.environ, **testbed.env(rank), BYTESCHEDULER_TIMELINE="")
        processes.append(Process(f"rank{rank}", testbed.wrap(rank, command), env))
    return processes


def horovod_ranks(testbed: Testbed, module: str, options: List[str], job_dir: str,
                  extra_env: Optional[Dict[str, str]] = None) -> List[Process]:
    """The processes of a Horovod job started as horovodrun --gloo would: a rendezvous server in
    rank 0's namespace and one ``python -m module --backend horovod ... options`` per rank."""
    from .rendezvous import host_plan

    port_file = os.path.join(job_dir, "rendezvous.port")
    hosts = ",".join(f"{name}:{count}" for name, count in Counter(testbed.hostname(r) for r in range(WORLD)).items())
    processes = []
    for slot in host_plan(hosts, WORLD):
        command = [sys.executable, "-m", module, "--backend", "horovod", "--rendezvous-port-file", port_file, *options]
        if isinstance(testbed, NamespaceTestbed):  # see worker.set_hostname
            command += ["--hostname", testbed.address(slot.rank)]
        env = dict(os.environ, **testbed.env(slot.rank), **(extra_env or {}), BYTESCHEDULER_TIMELINE="",
                   HOROVOD_GLOO_RENDEZVOUS_ADDR=testbed.master_addr, HOROVOD_CONTROLLER="gloo",
                   HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_HOSTNAME=slot.hostname, HOROVOD_RANK=str(slot.rank),
                   HOROVOD_SIZE=str(slot.size), HOROVOD_LOCAL_RANK=str(slot.local_rank),
                   HOROVOD_LOCAL_SIZE=str(slot.local_size), HOROVOD_CROSS_RANK=str(slot.cross_rank),
                   HOROVOD_CROSS_SIZE=str(slot.cross_size))
        processes.append(Process(f"rank{slot.rank}", testbed.wrap(slot.rank, command), env))
    server = [sys.executable, "-m", "bytescheduler_tools.bench.rendezvous", "--hosts", hosts, "--size", str(WORLD),
              "--port-file", port_file]
    processes.append(Process("rendezvous", testbed.wrap(0, server), dict(os.environ), helper=True))
    return processes


def mxnet_nodes(testbed: Testbed, worker: List[str], python: str, port: Optional[int] = None) -> List[Process]:
    """A ps-lite job: the scheduler (at ``port``, default a free one) in rank 0's namespace, a
    server and a worker (``worker``, a command) in each rank's."""
    # MXNet's engine settings as bytescheduler mxnet-launch gives them, to every system alike.
    base = with_engine_env({key: value for key, value in os.environ.items() if not key.startswith("DMLC_")})
    base.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", BYTESCHEDULER_TIMELINE="",
                DMLC_PS_ROOT_URI=testbed.master_addr, DMLC_PS_ROOT_PORT=str(port or free_port()),
                DMLC_NUM_SERVER=str(WORLD), DMLC_NUM_WORKER=str(WORLD))

    def node(role: str, rank: int, command: List[str]) -> Process:
        env = dict(base, **testbed.env(rank), DMLC_ROLE=role, DMLC_NODE_HOST=testbed.address(rank))
        return Process(f"{role}{rank}", testbed.wrap(rank, command), env)

    role = [python, "-c", "import mxnet"]  # importing MXNet runs a scheduler's or server's role
    processes = [node("worker", rank, worker) for rank in range(WORLD)]
    return processes + [node("scheduler", 0, role)] + [node("server", rank, role) for rank in range(WORLD)]


def run_torch_job(testbed: Testbed, args: argparse.Namespace, systems: List[str], work_dir: str,
                  end: float) -> List[List[dict]]:
    """The torch.distributed systems, alternating in one job; its per-rank results."""
    job_dir = _job_dir(work_dir, "torch")
    processes = torch_ranks(testbed, "bytescheduler_tools.bench.worker", _worker_options(args, systems, job_dir, args.rounds))
    run_processes("torch", processes, job_dir, end)
    return [_read_results(job_dir)]


def run_horovod_job(testbed: Testbed, args: argparse.Namespace, systems: List[str], work_dir: str,
                    end: float) -> List[List[dict]]:
    """The Horovod systems, alternating in one job started as horovodrun --gloo would; its per-rank results."""
    job_dir = _job_dir(work_dir, "horovod")
    options = _worker_options(args, systems, job_dir, args.rounds)
    run_processes("horovod", horovod_ranks(testbed, "bytescheduler_tools.bench.worker", options, job_dir), job_dir, end)
    return [_read_results(job_dir)]


def run_mxnet_jobs(testbed: Testbed, args: argparse.Namespace, systems: List[str], work_dir: str,
                   end: float) -> List[List[dict]]:
    """A job per MXNet system, all alive at once and taking turns (:class:`~bytescheduler_tools.bench.common.Turns`):
    every job's warm-up, then round by round one block per system in :func:`~bytescheduler_tools.bench.common.round_order`;
    per job, per-rank results (the link's job first)."""
    job_dir = _job_dir(work_dir, "mxnet-link")  # alone: its buffers would stay in a system's memory pool
    options = _worker_options(args, systems[:1], job_dir, 0, trace=False) + ["--link-only"]
    results = [_run_mxnet_job(testbed, args, options, job_dir, end)]
    dirs = {system: _job_dir(work_dir, f"mxnet-{system}") for system in systems}
    running: Dict[str, RunningJob] = {}
    ports: List[int] = []
    while len(ports) < len(systems):  # the jobs' schedulers share rank 0's namespace
        port = free_port()
        if port not in ports:
            ports.append(port)
    try:
        for (system, job_dir), port in zip(dirs.items(), ports):
            os.makedirs(os.path.join(job_dir, "turns"))
            options = _worker_options(args, [system], job_dir, args.rounds, link=False)
            options += ["--turns", os.path.join(job_dir, "turns")]
            running[system] = RunningJob("mxnet", _mxnet_job(args, testbed, options, port), job_dir,
                                         show_progress=False)
        # Nobody's turn starts until every job is up (a job starting up would slow the other's).
        _wait_for(running, [os.path.join(dirs[s], "turns", f"ready.rank{r}") for s in systems for r in range(WORLD)],
                  end)
        turns = [(system, 0) for system in systems]  # the warm-ups
        turns += [(system, 1 + r) for r in range(args.rounds) for system in round_order(systems, r)]
        total = args.rounds * len(systems)
        _progress("mxnet", 0, total)
        for index, (system, turn) in enumerate(turns):
            directory = os.path.join(dirs[system], "turns")
            touch(os.path.join(directory, f"go-{turn}"))
            _wait_for(running, [os.path.join(directory, f"done-{turn}.rank{r}") for r in range(WORLD)], end)
            if turn:
                _progress("mxnet", index + 1 - len(systems), total)
        while not all([job.poll(end) for job in running.values()]):
            time.sleep(0.2)
    finally:
        for job in running.values():
            job.stop()
    return results + [_read_results(dirs[system]) for system in systems]


def _wait_for(running: Dict[str, RunningJob], paths: List[str], end: float) -> None:
    """Until every file in ``paths`` exists, failing fast if a job fails."""
    while not all(os.path.exists(path) for path in paths):
        for job in running.values():
            job.poll(end)
        time.sleep(0.02)


def _run_mxnet_job(testbed: Testbed, args: argparse.Namespace, options: List[str], job_dir: str,
                   end: float) -> List[dict]:
    """A ps-lite job: the scheduler in rank 0's namespace, a server and a worker per rank's."""
    run_processes("mxnet", _mxnet_job(args, testbed, options), job_dir, end, show_progress=False)
    return _read_results(job_dir)


def _mxnet_job(args: argparse.Namespace, testbed: Testbed, options: List[str],
               port: Optional[int] = None) -> List[Process]:
    """The processes of a bench ps-lite job whose workers run ``mxnet_worker`` with ``options``."""
    worker = [args.mxnet_python, "-m", "bytescheduler_tools.bench.mxnet_worker", *options]
    return mxnet_nodes(testbed, worker, args.mxnet_python, port)


def _problem(command: List[str], env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """None when ``command`` succeeds, else the last line of its error output."""
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"


def horovod_problem() -> Optional[str]:
    problem = _problem([sys.executable, "-c", "import horovod.torch"])
    return None if problem is None else f"Horovod does not import ({problem}); make horovod installs it"


def default_mxnet_python() -> Optional[str]:
    """$BYTESCHEDULER_MXNET_PYTHON, else this checkout's .venv-mxnet/bin/python when it exists."""
    if os.environ.get(ENV_MXNET_PYTHON):
        return os.environ[ENV_MXNET_PYTHON]
    local = os.path.join(_REPO, ".venv-mxnet", "bin", "python")
    return local if os.path.exists(local) else None


def mxnet_problem(python: Optional[str], model: str) -> Optional[str]:
    if not python:
        return (f"no MXNet interpreter: pass --mxnet-python, set {ENV_MXNET_PYTHON}, "
                "or build .venv-mxnet (make mxnet)")
    env = {key: value for key, value in os.environ.items() if not key.startswith("DMLC_")}
    check = ("import sys, bytescheduler_tools.bench.mxnet_worker; from bytescheduler_tools.bench.mxnet_models import MODELS; "
             f"sys.exit(0 if {model!r} in MODELS else 'model {model} has no MXNet version; use one of ' "
             "+ ', '.join(MODELS))")
    problem = _problem([python, "-c", check], env)
    return None if problem is None else f"{python}: {problem}"


def choose_systems(args: argparse.Namespace) -> Tuple[List[str], Dict[str, str]]:
    """The systems to run and those left out (system -> why); exits when asked-for ones cannot run."""
    if args.quick:
        return list(QUICK_SYSTEMS), {}
    explicit = args.systems is not None
    wanted = list(dict.fromkeys(args.systems)) if explicit else list(DEFAULT_SYSTEMS)
    problems = {}
    if any(name in HOROVOD_SYSTEMS for name in wanted):
        problems[HOROVOD_SYSTEMS] = horovod_problem()
    if any(name in MXNET_SYSTEMS for name in wanted):
        # Asked for by name with --lead-in, check_lead_in has refused them already.
        problems[MXNET_SYSTEMS] = (_LEAD_IN_MXNET if args.lead_in
                                   else mxnet_problem(args.mxnet_python, args.model))
    left_out = {}
    for group, problem in problems.items():
        names = [name for name in wanted if name in group]
        if problem is None:
            continue
        if explicit:
            raise SystemExit(f"bytescheduler bench: cannot run {' '.join(names)}: {problem}")
        left_out.update({name: problem for name in names})
    return [name for name in wanted if name not in left_out], left_out


# Why --lead-in and the MXNet systems do not go together (an error when they are asked for by
# name, the reason they are left out of the default set).
_LEAD_IN_MXNET = ("MXNet's engine runs gluon's training thread ahead of the work it queues, so a span that "
                  "ends without waiting would time the queueing; leave --lead-in out, or run the MXNet "
                  "systems apart")


def check_lead_in(lead_in: int, systems: List[str]) -> None:
    """``--lead-in`` times a span that ends without waiting for communication: that measures
    whole periods only where each iteration bounds how far the training thread runs ahead
    (DDP and Horovod wait inside ``step()``, ScheduledOptimizer's forward waits for each
    layer). MXNet's engine queues a whole block without running it, so it is refused there."""
    if lead_in < 0:
        raise SystemExit(f"bytescheduler bench: --lead-in must be 0 or more, not {lead_in}")
    mxnet = [name for name in systems if name in MXNET_SYSTEMS]
    if lead_in and mxnet:
        raise SystemExit(f"bytescheduler bench: --lead-in cannot time {' '.join(mxnet)}: {_LEAD_IN_MXNET}")


def shaping_problem() -> Optional[str]:
    """None when a shaped testbed can be made here (tried: root alone is not enough inside a
    container without NET_ADMIN and SYS_ADMIN), else why not."""
    with make_testbed(WORLD, "1gbit") as probe:
        return None if isinstance(probe, NamespaceTestbed) else probe.description


def quick_shaped(out: str, no_pin: bool, problem: Optional[str]) -> int:
    """The demo's first part (:data:`QUICK_SHAPED`, into ``out``/1gbit) where ``problem`` is
    None; else a note on how to see the win. Its exit code (0 for the note)."""
    shaped = ["bytescheduler", "bench", *QUICK_SHAPED]
    if problem is not None:
        print(f"No shaped link here ({problem}), so the demo runs on loopback only, where communication is cheap "
              "and there is nothing to win. To see the win, run as root (in Docker: --cap-add NET_ADMIN "
              f"--cap-add SYS_ADMIN):\n\n    {' '.join(shaped)}\n")
        return 0
    print("Part 1 of 2: a 1 Gbit/s link, where communication is the bottleneck.\n", flush=True)
    code = main([*QUICK_SHAPED, "--out", os.path.join(out, "1gbit"), *(["--no-pin"] if no_pin else [])])
    print("\nPart 2 of 2: loopback, where communication is cheap: what scheduling costs.\n", flush=True)
    return code


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="bytescheduler bench", description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="none", help="link rate per direction, e.g. 1gbit, 2gbit, or none")
    parser.add_argument("--model", default="vgg", choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                        help="default: every system whose framework is available, but ddp-torch-hook "
                             "(DDP with PyTorch's own allreduce_hook: what any Python comm hook costs) and "
                             "the A/A controls ddp-again, hvd-again and mxnet-again (a second copy of the baseline: "
                             "the spread of the bench itself)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up iterations per system")
    parser.add_argument("--iters", type=int, default=3, help="iterations per timed block")
    parser.add_argument("--blocks", "--rounds", dest="rounds", type=int, default=8, metavar="N",
                        help="timed blocks per system, the systems alternating block by block")
    parser.add_argument("--lead-in", type=int, default=0, metavar="ITERS",
                        help="measure the steady state: ITERS untimed iterations start each block, and the "
                        "timed span ends with the last timed iteration, its pending communication waited for "
                        "after it (default 0: each block runs from rest to rest, which charges cross-iteration "
                        "overlap one forward and one backward per block)")
    parser.add_argument("--from-start", action="store_true",
                        help="time the blocks right after --warmup, the mode switch's first choice included "
                        "(what a short training or a first try sees; by default the warm-up goes on until "
                        "the mode switch has chosen)")
    parser.add_argument("--partition", default=None, help="partition size (default: the library's)")
    parser.add_argument("--credit", default=None, help="credit size (default: the library's)")
    parser.add_argument("--auto-tune", type=int, default=0, metavar="STEPS",
                        help="auto-tune partition and credit of the scheduled torch systems during STEPS "
                        "extra warm-up steps (the tables then show the tuned setting)")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin each rank to a CPU of its own (pinned by default when there are enough)")
    parser.add_argument("--mxnet-python", default=default_mxnet_python(),
                        help=f"interpreter with MXNet and bytescheduler (default: ${ENV_MXNET_PYTHON}, "
                        "else this checkout's .venv-mxnet/bin/python)")
    parser.add_argument("--deadline", type=float, default=3600,
                        help="seconds each framework's job(s) may take before they are killed")
    parser.add_argument("--out", default="bench-results", help="folder for results, tables and charts")
    parser.add_argument("--quick", action="store_true",
                        help="the README's demo, torch systems only (about 2 minutes): where a link can be shaped "
                        "(root), vgg-small at 1 Gbit/s first; then loopback, small model, few blocks")
    args = parser.parse_args(argv)
    if args.quick:
        code = quick_shaped(args.out, args.no_pin, shaping_problem())
        if code != 0:
            return code
        args.bandwidth, args.model, args.batch_size = "none", "vgg-small", 16
        # 16 blocks: with 4, runs of the same code moved by +-5% on a shared machine, and
        # with 12 a ratio's median still had ~2.5% standard error (iterations spread ~10%).
        args.warmup, args.iters, args.rounds = 3, 10, 16
    started = time.monotonic()
    check_lead_in(args.lead_in, args.systems or [])  # asked for by name: before looking for MXNet
    systems, left_out = choose_systems(args)  # by default, --lead-in leaves the MXNet systems out
    args.systems = systems
    os.makedirs(args.out, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so every job's processes are killed and the namespaces torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs = [(job, run, [name for name in systems if name in group]) for job, run, group in (
        ("torch", run_torch_job, TORCH_SYSTEMS), ("horovod", run_horovod_job, HOROVOD_SYSTEMS),
        ("mxnet", run_mxnet_jobs, MXNET_SYSTEMS))]
    try:
        with make_testbed(WORLD, args.bandwidth) as testbed:
            if not args.no_pin:
                testbed.cores = pin_cores(WORLD)
            if testbed.cores:
                testbed.description += ("; each rank's processes pinned to a CPU of their own ("
                                        + ", ".join(f"rank {r}: CPU {c}" for r, c in enumerate(testbed.cores)) + ")")
            print(f"bytescheduler bench: model {args.model}, batch {args.batch_size} per rank, {WORLD} ranks, "
                  f"systems {' '.join(systems)}", file=sys.stderr)
            for name, why in left_out.items():
                print(f"  left out {name}: {why}", file=sys.stderr)
            print(f"  network: {testbed.description}", file=sys.stderr)
            with tempfile.TemporaryDirectory(prefix="bytescheduler-bench-") as work_dir:
                args.trace_dir = os.path.join(work_dir, "traces")
                os.makedirs(args.trace_dir)
                jobs: List[Tuple[str, List[dict]]] = []
                try:
                    for job, run, names in runs:
                        if names:
                            deadline = time.monotonic() + args.deadline
                            jobs += [(LINKS[job], results) for results in run(testbed, args, names, work_dir, deadline)]
                except JobFailed as error:
                    show_logs(error.log_dir)
                    print(f"bench: {error}", file=sys.stderr)
                    return 1
                command = " ".join(["bytescheduler", "bench", *(argv if argv is not None else sys.argv[1:])])
                table = report(merge(jobs), args, testbed.description, args.trace_dir, args.out, command=command,
                               left_out=left_out)
                # The Chrome traces behind the timeline pictures (open them in chrome://tracing or Perfetto).
                shutil.copytree(args.trace_dir, os.path.join(args.out, "traces"), dirs_exist_ok=True)
    except KeyboardInterrupt:
        print("\nbench: interrupted; every process stopped, the testbed torn down", file=sys.stderr)
        return 130
    print(table)
    print(f"results in {os.path.abspath(args.out)} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


def show_logs(log_dir: str) -> None:
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".log"):
            with open(os.path.join(log_dir, name)) as handle:
                lines = handle.readlines()[-20:]
            if lines:
                print(f"--- {name} (last lines)\n" + "".join(lines), file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
