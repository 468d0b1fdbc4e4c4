"""``bytescheduler bench``: measure every system on a (bandwidth-limited) 2-rank testbed.

    bytescheduler bench --quick                       # loopback, small model, under 2 minutes
    bytescheduler bench --bandwidth 1gbit --model vgg --rounds 10 --iters 3
    bytescheduler bench --bandwidth 2gbit --out results/2gbit

Writes ``results.json``, ``results.md``, ``speed.png`` and one ``timeline-<system>.png``
per system into ``--out`` and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

from ..models import MODELS
from .report import report
from .testbed import Testbed, make_testbed

TORCH_SYSTEMS = ("compute", "comm", "ddp", "ddp-hook", "scheduled")


class JobFailed(RuntimeError):
    pass


def run_torch_job(testbed: Testbed, args: argparse.Namespace, work_dir: str, world_size: int = 2) -> List[dict]:
    """Run one benchmark job (all torch systems alternating) on ``world_size`` ranks; return per-rank results."""
    port = _free_port()  # free on the host; namespaces start with every port free
    trace_dir = os.path.join(work_dir, "traces")
    os.makedirs(trace_dir, exist_ok=True)
    processes = []
    logs = []
    try:
        for rank in range(world_size):
            output = os.path.join(work_dir, f"rank{rank}.json")
            command = [
                sys.executable, "-m", "bytescheduler.bench.worker", "--rank", str(rank), "--world-size",
                str(world_size), "--master", testbed.master_addr, "--port", str(port), "--model", args.model,
                "--batch-size", str(args.batch_size), "--systems", *args.systems, "--warmup", str(args.warmup),
                "--iters", str(args.iters), "--rounds", str(args.rounds), "--trace-dir", trace_dir,
                "--output", output,
            ]
            if args.partition:
                command += ["--partition", args.partition]
            if args.credit:
                command += ["--credit", args.credit]
            log = open(os.path.join(work_dir, f"rank{rank}.log"), "w")
            logs.append(log)
            env = dict(os.environ, **testbed.env(rank), BYTESCHEDULER_TIMELINE="")
            processes.append(subprocess.Popen(
                testbed.wrap(rank, command), env=env, start_new_session=True,
                stdout=subprocess.PIPE if rank == 0 else log, stderr=log,
            ))
        _follow(processes, args.deadline)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        for log in logs:
            log.close()
    results = []
    for rank in range(world_size):
        with open(os.path.join(work_dir, f"rank{rank}.json")) as handle:
            results.append(json.load(handle))
    return results


def _follow(processes: List[subprocess.Popen], deadline: float) -> None:
    """Show rank 0's progress; fail fast when a rank fails or the deadline passes."""
    end = time.monotonic() + deadline
    stream = processes[0].stdout.fileno()
    os.set_blocking(stream, False)
    buffered = ""
    while True:
        try:
            buffered += os.read(stream, 65536).decode(errors="replace")
        except BlockingIOError:
            pass
        *lines, buffered = buffered.split("\n")
        for line in lines:
            if line.startswith("PROGRESS "):
                done, total = (int(x) for x in line.split()[1].split("/"))
                bar = "#" * (30 * done // total)
                print(f"\r  rounds [{bar:<30}] {done}/{total}", end="", file=sys.stderr, flush=True)
            elif line.strip():
                print(line, file=sys.stderr)
        codes = [p.poll() for p in processes]
        if all(code == 0 for code in codes):
            print(file=sys.stderr)
            return
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            raise JobFailed(f"rank(s) {failed} failed (exit codes {codes}); see their logs")
        if time.monotonic() > end:
            raise JobFailed(f"the job did not finish within {deadline} s")
        time.sleep(0.2)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="bytescheduler bench", description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="none", help="link rate per direction, e.g. 1gbit, 2gbit, or none")
    parser.add_argument("--model", default="vgg", choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--systems", nargs="+", default=list(TORCH_SYSTEMS), choices=TORCH_SYSTEMS)
    parser.add_argument("--warmup", type=int, default=3, help="warm-up iterations per system")
    parser.add_argument("--iters", type=int, default=3, help="iterations per timed block")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds (blocks per system)")
    parser.add_argument("--partition", default=None, help="partition size (default: the library's)")
    parser.add_argument("--credit", default=None, help="credit size (default: the library's)")
    parser.add_argument("--deadline", type=float, default=3600, help="seconds before the job is killed")
    parser.add_argument("--out", default="bench-results", help="folder for results, tables and charts")
    parser.add_argument("--quick", action="store_true",
                        help="loopback, small model, few rounds: the README's demo (under 2 minutes)")
    args = parser.parse_args(argv)
    if args.quick:
        args.bandwidth, args.model, args.batch_size = "none", "vgg-small", 16
        args.warmup, args.iters, args.rounds = 2, 3, 5
        args.systems = ["compute", "ddp", "ddp-hook", "scheduled"]
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    # SIGTERM unwinds like Ctrl-C, so the testbed's namespaces are always torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with make_testbed(2, args.bandwidth) as testbed:
        print(f"bytescheduler bench: model {args.model}, batch {args.batch_size} per rank, 2 ranks, "
              f"systems {' '.join(args.systems)}", file=sys.stderr)
        print(f"  network: {testbed.description}", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="bytescheduler-bench-") as work_dir:
            try:
                results = run_torch_job(testbed, args, work_dir)
            except JobFailed as error:
                for name in sorted(os.listdir(work_dir)):
                    if name.endswith(".log"):
                        with open(os.path.join(work_dir, name)) as handle:
                            print(f"--- {name} (last lines)\n" + "".join(handle.readlines()[-20:]), file=sys.stderr)
                print(f"bench: {error}", file=sys.stderr)
                return 1
            table = report(results, args, testbed.description, os.path.join(work_dir, "traces"), args.out,
                           command=" ".join(["bytescheduler", "bench", *(argv if argv is not None else sys.argv[1:])]))
    print(table)
    print(f"results in {os.path.abspath(args.out)} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
