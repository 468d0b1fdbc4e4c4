"""The ScheduledOptimizer examples run as a user runs them: torchrun and horovodrun, 2 processes."""

import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
TIMEOUT = 180
SMALL = [
    "--model", "tiny", "--batch-size", "8", "--num-warmup-batches", "2", "--num-iters", "2",
    "--num-batches-per-iter", "2", "--partition", "64KiB",
]


def _env():
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")  # horovodrun starts the first python on PATH
    for name in list(env):
        if name.startswith(("HOROVOD_", "BYTESCHEDULER_")):
            del env[name]
    return env


def _run(command):
    """Run ``command`` in a session of its own; on a hang kill what it started and fail."""
    process = subprocess.Popen(
        command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        descendants = []
        try:
            import psutil

            descendants = psutil.Process(process.pid).children(recursive=True)
        except Exception:  # noqa: BLE001
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for child in descendants:  # horovodrun's workers run in sessions of their own
            try:
                child.kill()
            except Exception:  # noqa: BLE001
                pass
        stdout, stderr = process.communicate()
        pytest.fail(f"{command} did not finish within {TIMEOUT} s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return process.returncode, stdout, stderr


def _check(code, stdout, stderr, system):
    assert code == 0, f"exit code {code}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    assert f"system: {system}" in stdout, stdout[-3000:]
    assert "samples/s" in stdout and "s/iter" in stdout, stdout[-3000:]
    assert "model tiny, 2 ranks" in stdout, stdout[-3000:]


@pytest.mark.parametrize("extra, system", [
    ([], "ScheduledOptimizer (bytescheduler)"),
    (["--no-bytescheduler"], "DDP default"),
], ids=["scheduled", "baseline"])
def test_scheduled_optimizer_example_under_torchrun(extra, system):
    from tests.distributed import free_port

    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        os.path.join(ROOT, "examples", "pytorch_scheduled_optimizer.py"), *SMALL, "--credit", "256KiB", *extra,
    ]
    _check(*_run(command), system)


@pytest.mark.parametrize("extra, system", [
    ([], "Horovod + bytescheduler"),
    (["--no-bytescheduler"], "Horovod DistributedOptimizer"),
], ids=["scheduled", "baseline"])
def test_horovod_benchmark_example_under_horovodrun(extra, system):
    command = [
        os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
        sys.executable, os.path.join(ROOT, "examples", "pytorch_horovod_benchmark.py"), *SMALL, *extra,
    ]
    _check(*_run(command), system)
