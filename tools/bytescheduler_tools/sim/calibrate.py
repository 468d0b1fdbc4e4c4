"""``bytescheduler calibrate``: measure what communication costs here, per backend, for the simulator.

    bytescheduler calibrate --out calibration.json                      # loopback, every backend available
    bytescheduler calibrate --bandwidth 1gbit --backends gloo horovod   # the shaped testbed (root)
    bytescheduler simulate --model vgg --calibration calibration.json

Runs 2 ranks per backend as ``bytescheduler bench`` runs them (each rank pinned to a CPU of
its own; with ``--bandwidth`` in network namespaces joined by rate-shaped links): gloo
through torch.distributed, Horovod (``make horovod``), MXNet's ps-lite (``make mxnet``; a
server on each rank's CPU). Each rank measures (:mod:`~bytescheduler_tools.sim.probe_torch`,
:mod:`~bytescheduler_tools.sim.probe_mxnet`) the fixed cost of one small operation, the rate of
large ones, and the CPU its core spends per operation and per byte; the command turns the
two ranks' reports into a :class:`~bytescheduler_tools.sim.calibration.Calibration` (JSON). The
numbers come from the run: nothing is assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from statistics import mean
from typing import Dict, List, Optional

from ..bench.runner import (JobFailed, default_mxnet_python, horovod_problem, horovod_ranks, mxnet_nodes,
                            run_processes, show_logs, torch_ranks)
from ..bench.testbed import Testbed, make_testbed, pin_cores
from .calibration import BACKENDS, BackendCosts, Calibration, busy_elsewhere, derive

WORLD = 2


def _mxnet_problem(python: Optional[str]) -> Optional[str]:
    if not python:
        return "no MXNet interpreter: pass --mxnet-python, or build .venv-mxnet (make mxnet)"
    env = {key: value for key, value in os.environ.items() if not key.startswith("DMLC_")}
    done = subprocess.run([python, "-c", "import bytescheduler_tools.sim.probe_mxnet"], env=env, capture_output=True,
                          text=True, timeout=180)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return f"{python}: {lines[-1] if lines else done.returncode}"


def _run(backend: str, testbed: Testbed, args: argparse.Namespace, work_dir: str) -> List[dict]:
    job_dir = os.path.join(work_dir, backend)
    os.makedirs(job_dir)
    output = os.path.join(job_dir, "rank{rank}.json")
    options = ["--small-ops", str(args.small_ops), "--large-ops", str(args.large_ops),
               "--megabytes", str(args.megabytes), "--output", output]
    end = time.monotonic() + args.deadline
    if backend == "gloo":
        processes = torch_ranks(testbed, "bytescheduler_tools.sim.probe_torch", options)
    elif backend == "horovod":
        processes = horovod_ranks(testbed, "bytescheduler_tools.sim.probe_torch", options, job_dir)
    else:
        processes = mxnet_nodes(testbed, [args.mxnet_python, "-m", "bytescheduler_tools.sim.probe_mxnet", *options],
                                args.mxnet_python)
    run_processes(backend, processes, job_dir, end, show_progress=False)
    reports = []
    for rank in range(WORLD):
        with open(output.replace("{rank}", str(rank))) as handle:
            reports.append(json.load(handle))
    return reports


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="bytescheduler calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                        help="default: every backend whose framework is available")
    parser.add_argument("--bandwidth", default="none", help="link rate per direction, e.g. 1gbit, or none (loopback)")
    parser.add_argument("--out", default="calibration.json")
    parser.add_argument("--small-ops", type=int, default=300, help="one-element operations timed (default 300)")
    parser.add_argument("--large-ops", type=int, default=6, help="large operations timed (default 6)")
    parser.add_argument("--megabytes", type=int, default=32, help="size of a large operation (default 32)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin each rank to a CPU of its own")
    parser.add_argument("--mxnet-python", default=default_mxnet_python(),
                        help="interpreter with MXNet and bytescheduler (default: as bytescheduler bench)")
    parser.add_argument("--deadline", type=float, default=600, help="seconds each backend's job may take")
    args = parser.parse_args(argv)
    problems = {"horovod": horovod_problem, "ps-lite": lambda: _mxnet_problem(args.mxnet_python)}
    wanted = args.backends or list(BACKENDS)
    backends = []
    for backend in wanted:
        problem = problems[backend]() if backend in problems else None
        if problem is None:
            backends.append(backend)
        elif args.backends:
            raise SystemExit(f"bytescheduler calibrate: cannot measure {backend}: {problem}")
        else:
            print(f"  left out {backend}: {problem}", file=sys.stderr)
    costs: Dict[str, BackendCosts] = {}
    raw: Dict[str, List[dict]] = {}
    with make_testbed(WORLD, args.bandwidth) as testbed:
        if not args.no_pin:
            testbed.cores = pin_cores(WORLD)
        pinned = bool(testbed.cores)
        print(f"bytescheduler calibrate: {', '.join(backends)} on {testbed.description}"
              f"{'; each rank pinned to a CPU of its own' if pinned else ''}", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="bytescheduler-calibrate-") as work_dir:
            for backend in backends:
                try:
                    raw[backend] = _run(backend, testbed, args, work_dir)
                except JobFailed as error:
                    show_logs(error.log_dir)
                    print(f"calibrate: {error}", file=sys.stderr)
                    return 1
                costs[backend] = derive(backend, raw[backend])
        description = testbed.description
    memcpy = mean(r["memcpy_bytes_per_s"] for reports in raw.values() for r in reports) if raw else 0.0
    elsewhere = busy_elsewhere(raw) if pinned else 0.0
    calibration = Calibration(costs, memcpy, cores=1 if pinned else os.cpu_count() or 1, network=description,
                              busy_elsewhere=elsewhere, raw=raw)
    with open(args.out, "w") as handle:
        handle.write(calibration.to_json())
    print(summary(calibration))
    if elsewhere > 0.1:
        print(f"calibrate: warning: other processes kept the ranks' CPUs {100 * elsewhere:.0f}% busy while the "
              "ranks idled; the costs include that contention (CPU time stretches on a shared core): "
              "calibrate on a quiet machine", file=sys.stderr)
    print(f"written to {os.path.abspath(args.out)}", file=sys.stderr)
    return 0


def summary(calibration: Calibration) -> str:
    """A markdown table of the measured costs."""
    lines = [f"Calibration ({calibration.network}); memcpy {calibration.memcpy_bytes_per_s / 1e9:.2f} GB/s per thread.",
             "", "| backend | fixed us/op | CPU us/op | CPU ns/byte | rate MB/s | idle CPU ms/s | ours us/op "
             "| hook us/gradient (ours) | server us/op | server ns/byte |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in calibration.backends.items():
        lines.append(f"| {name} | {c.op_seconds * 1e6:.0f} | {c.cpu_per_op * 1e6:.0f} | {c.cpu_per_byte * 1e9:.3f} | "
                     f"{c.rate / 1e6:.0f} | {c.idle_cpu_per_s * 1e3:.1f} | {c.ours_cpu_per_op * 1e6:.0f} | "
                     f"{c.hook_cpu * 1e6:.0f} ({c.ours_hook_cpu * 1e6:.0f}) | "
                     f"{c.server_cpu_per_op * 1e6:.0f} | {c.server_cpu_per_byte * 1e9:.3f} |")
    return "\n".join(lines)
