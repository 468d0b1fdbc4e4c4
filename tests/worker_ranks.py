"""Two ranks of a framework's own launch, as an external launcher starts them.

:func:`run_worker` starts ``python -m WORKER SCENARIO OUT`` twice with the variables of an
external launcher (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``NODE_RANK`` and, for ``torchrun``-style launches, ``RANK``), so the framework under test
(Lightning, Accelerate, the ``transformers`` Trainer) creates the gloo process group itself.
Each rank saves its results to ``OUT/SCENARIO.rank<N>.pt``; the comparisons below read them.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from tests.distributed import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]

# What would make a framework pick another cluster environment or world: not ours to inherit.
_FOREIGN = ("SLURM_", "LSB_", "LSF_", "TORCHELASTIC_", "PMI_", "OMPI_", "KUBERNETES_", "ACCELERATE_")
_FOREIGN_NAMES = {"RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "NODE_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "JSM_NAMESPACE_RANK", "PL_GLOBAL_SEED"}


def _env(rank: int, port: int, global_rank: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in _FOREIGN_NAMES and not k.startswith(_FOREIGN) and not k.startswith("BYTESCHEDULER_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
               WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if global_rank:
        env["RANK"] = str(rank)
    return env


def run_worker(worker: str, scenario: str, out: pathlib.Path, deadline: float, global_rank: bool = True,
               testbed: Any = None) -> list:
    """Both ranks of ``scenario``; their saved results. Kills only the processes it started.

    ``testbed``: a :class:`bytescheduler_tools.bench.testbed.Testbed` (e.g. two network
    namespaces joined by a shaped link) to run the ranks in."""
    port = free_port()
    logs = [out / f"{scenario}.rank{rank}.log" for rank in range(2)]
    processes = []
    try:
        for rank in range(2):
            command = [sys.executable, "-m", worker, scenario, str(out)]
            env = _env(rank, port, global_rank)
            if testbed is not None:
                command = testbed.wrap(rank, command)
                env.update(testbed.env(rank), MASTER_ADDR=testbed.master_addr)
            with open(logs[rank], "w") as log:
                processes.append(subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        end = time.monotonic() + deadline
        while any(p.poll() is None for p in processes):
            failed = [r for r, p in enumerate(processes) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > end:
                time.sleep(3 if failed else 0)  # let the other rank report its side of a failure
                why = f"rank(s) {failed} failed" if failed else f"deadline of {deadline} s passed"
                pytest.fail(f"{scenario}: {why}\n" + _tails(logs, processes))
            time.sleep(0.2)
        if any(p.returncode != 0 for p in processes):
            pytest.fail(f"{scenario}: a rank failed\n" + _tails(logs, processes))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    return [torch.load(out / f"{scenario}.rank{rank}.pt", weights_only=False) for rank in range(2)]


def _tails(logs, processes) -> str:
    parts = []
    for rank, (log, process) in enumerate(zip(logs, processes)):
        text = log.read_text() if log.exists() else ""
        parts.append(f"--- rank {rank} (exit {process.poll()}):\n{text[-6000:]}")
    return "\n".join(parts)


def assert_same_state(ours: dict, theirs: dict, what: str) -> None:
    """Bitwise: every parameter and buffer."""
    assert ours.keys() == theirs.keys(), what
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), (
            f"{what}: {name} differs by up to {(ours[name].double() - value.double()).abs().max().item()}")


def assert_same_run(ours: dict, theirs: dict, what: str) -> None:
    """Bitwise: every parameter and buffer, and every loss, in order."""
    assert_same_state(ours["state"], theirs["state"], what)
    assert len(ours["loss_tensors"]) == len(theirs["loss_tensors"]) > 0, what
    for step, (a, b) in enumerate(zip(ours["loss_tensors"], theirs["loss_tensors"])):
        assert torch.equal(a, b), f"{what}: the loss of step {step} differs: {a.item()!r} != {b.item()!r}"


def assert_timeline_ran(out: pathlib.Path, name: str) -> None:
    """Each rank's Chrome trace is complete (closed at the end) and has operations in it."""
    for rank in range(2):
        path = out / f"{name}.rank{rank}.json"
        assert path.exists(), f"no timeline for rank {rank}: {path}"
        events = json.loads(path.read_text())
        categories = {event.get("cat") for event in events}
        assert "task" in categories and any(str(c).startswith("lane") for c in categories), (path, categories)
        assert sum(1 for event in events if event.get("cat") == "task") >= 4, path
