"""The examples run as a user runs them: under torchrun, 2 processes."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("extra", [[], ["--no-bytescheduler"]], ids=["scheduled", "baseline"])
def test_ddp_hook_example_under_torchrun(extra):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_port()),
        os.path.join(ROOT, "examples", "pytorch_ddp_hook.py"),
        "--model", "tiny", "--batch-size", "8", "--num-iters", "2", "--num-batches-per-iter", "2",
        "--partition", "64KiB", "--credit", "256KiB", *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "samples/s" in done.stdout
    expected = "DDP default" if extra else "DDP + bytescheduler hook"
    assert expected in done.stdout


def test_demo_command_prints_table_and_identical_parameters():
    done = subprocess.run(
        [sys.executable, "-m", "bytescheduler.cli", "demo", "--iters", "1", "--rounds", "2", "--warmup", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "| DDP default |" in done.stdout and "| DDP + scheduled hook |" in done.stdout
    assert "parameters identical after training: True" in done.stdout


def test_cli_rejects_unknown_command():
    done = subprocess.run([sys.executable, "-m", "bytescheduler.cli", "bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown command" in done.stderr


def _port():
    from tests.distributed import free_port

    return free_port()
