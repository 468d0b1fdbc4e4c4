"""The Docker images, built and run as docs/docker.md says: the demo and a short scheduled run in each.

Run by ``make docker-test`` (and CI), which builds the images first and starts a Docker daemon
when none runs; the main test run leaves this folder out (tests/conftest.py). An image that is
missing is a failure, never a skip.

Containers run with ``--network none`` (every rank talks over the container's loopback or the
namespaces the benchmark makes inside it, nothing leaves the machine) and ``--hostname
localhost`` (Horovod's gloo resolves the host name, which has no address without a network).
The shaped testbed needs ``--cap-add NET_ADMIN --cap-add SYS_ADMIN``: that this suffices is
tested here.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from typing import List

import pytest

IMAGES = ("pytorch", "horovod", "mxnet")
SHAPING_CAPABILITIES = ["--cap-add", "NET_ADMIN", "--cap-add", "SYS_ADMIN"]


def docker_run(image: str, *command: str, options: List[str] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    """``docker run --rm`` with a deadline; a container still running at the deadline is removed."""
    name = f"bytescheduler-test-{uuid.uuid4().hex[:8]}"
    argv = ["docker", "run", "--rm", "--name", name, "--network", "none", "--hostname", "localhost",
            *options, f"bytescheduler:{image}", *command]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


def report(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"


@pytest.fixture(scope="module", autouse=True)
def no_container_left_behind():
    yield
    left = subprocess.run(["docker", "ps", "-q", "--filter", "name=bytescheduler-test-"],
                          capture_output=True, text=True, timeout=60).stdout.split()
    assert not left, f"containers left running: {left}"


@pytest.mark.parametrize("image", IMAGES)
def test_image_has_the_cpu_torch_and_its_framework(image):
    check = {
        "pytorch": "import torch; print(torch.__version__, torch.version.cuda)",
        "horovod": "import torch, horovod.torch as hvd; hvd.init(); print(torch.__version__, torch.version.cuda, hvd.size())",
        "mxnet": "import torch; print(torch.__version__, torch.version.cuda)",
    }[image]
    # In the MXNet image plain `python` is MXNet's environment; torch's is .venv's.
    done = docker_run(image, ".venv/bin/python" if image == "mxnet" else "python", "-c", check, timeout=120)
    assert done.returncode == 0, report(done)
    assert re.fullmatch(r"\d+\.\d+\.\d+\+cpu None( 1)?", done.stdout.strip()), report(done)
    if image == "mxnet":
        done = docker_run(image, "python", "-c",
                          "import mxnet, numpy, bytescheduler.mxnet; print(mxnet.__version__, numpy.__version__)",
                          timeout=120)
        assert done.returncode == 0 and done.stdout.split() == ["1.9.1", "1.23.5"], report(done)


DEMO_ROWS = ("compute only (no communication)", "DDP default", "DDP + scheduled hook", "ScheduledOptimizer")


@pytest.mark.timeout(420)
def test_pytorch_image_runs_the_readme_demo_by_default():
    # Without the capabilities no link can be shaped: the demo says how to see the win, then
    # runs on loopback.
    done = docker_run("pytorch", timeout=400)
    assert done.returncode == 0, report(done)
    assert "No shaped link here" in done.stdout and "--cap-add NET_ADMIN" in done.stdout, report(done)
    assert "Part 1 of 2" not in done.stdout, report(done)
    for row in DEMO_ROWS:
        assert re.search(rf"^\| {re.escape(row)} \| \d+\.\d+ \|", done.stdout, re.M), report(done)
    assert "Command: `bytescheduler bench --quick`" in done.stdout, report(done)


@pytest.mark.timeout(420)
def test_pytorch_images_demo_with_the_capabilities_runs_1gbit_first_then_loopback():
    done = docker_run("pytorch", "bytescheduler", "bench", "--quick", options=SHAPING_CAPABILITIES, timeout=400)
    assert done.returncode == 0, report(done)
    first, _, second = done.stdout.partition("Part 2 of 2")
    assert "Part 1 of 2" in first and second, report(done)
    assert "2 network namespaces, veth links shaped to 1gbit each way" in first, report(done)
    assert "Command: `bytescheduler bench --bandwidth 1gbit --model vgg-small" in first, report(done)
    assert "Command: `bytescheduler bench --quick`" in second, report(done)
    for part in (first, second):
        for row in DEMO_ROWS:
            assert re.search(rf"^\| {re.escape(row)} \| \d+\.\d+ \|", part, re.M), report(done)


# Per image: the systems of its framework, the table rows they make, how the job measures the
# link and the least rate that measurement shows on a working 1 Gbit/s link. gloo and Horovod
# measure 0.96 Gbit/s here; ps-lite's push+pull is CPU-bound below the rate (0.91-0.92 Gbit/s
# alone, 0.77 with a test suite sharing the 2 cores).
SCHEDULED_RUNS = {
    "pytorch": (["ddp", "scheduled"], ["DDP default", "ScheduledOptimizer"], "gloo all-reduce", 0.8),
    "horovod": (["hvd", "hvd-scheduled"], ["Horovod DistributedOptimizer", "Horovod + ScheduledOptimizer"],
                "Horovod all-reduce", 0.8),
    "mxnet": (["mxnet", "mxnet-scheduled"], ["MXNet dist_sync", "MXNet + ScheduledKVStore"], "ps-lite push+pull", 0.5),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("image", IMAGES)
def test_short_scheduled_run_on_a_1gbit_testbed_inside_the_image(image):
    systems, rows, link, least_gbit = SCHEDULED_RUNS[image]
    done = docker_run(image, "bytescheduler", "bench", "--bandwidth", "1gbit", "--model", "tiny",
                      "--batch-size", "8", "--systems", *systems, "--rounds", "2", "--iters", "2",
                      "--warmup", "1", "--deadline", "300", options=SHAPING_CAPABILITIES, timeout=400)
    assert done.returncode == 0, report(done)
    # Really shaped: no fallback to loopback, and the link runs near the set rate, never above it.
    assert "2 network namespaces, veth links shaped to 1gbit each way" in done.stdout, report(done)
    measured = re.search(rf"([\d.]+) Gbit/s per direction by {re.escape(link)}", done.stdout)
    assert measured and least_gbit <= float(measured.group(1)) <= 1.05, report(done)
    assert re.search(rf"^\| {re.escape(rows[0])} \| \d+\.\d+ \|", done.stdout, re.M), report(done)
    assert re.search(rf"^\| {re.escape(rows[1])} \| \d+\.\d+ \| [\d.-]+ \| [\d.]+ \| \d+\.\d+x vs {re.escape(rows[0])} \|",
                     done.stdout, re.M), report(done)


@pytest.mark.timeout(420)
def test_horovod_image_runs_the_example_under_horovodrun_by_default():
    done = docker_run("horovod", timeout=400)
    assert done.returncode == 0, report(done)
    for system in ("Horovod + bytescheduler", "Horovod DistributedOptimizer"):
        assert re.search(rf"^\[0\]<stdout>:{re.escape(system)}: model vgg, 2 ranks, batch 32 per rank, "
                         r"median \d+\.\d+ s/iter, \d+\.\d+ samples/s$", done.stdout, re.M), report(done)


@pytest.mark.timeout(420)
def test_mxnet_image_runs_the_ps_example_with_the_same_checksum_with_and_without_bytescheduler():
    done = docker_run("mxnet", timeout=400)
    assert done.returncode == 0, report(done)
    for label in ("bytescheduler", "plain dist_sync"):
        for rank in (0, 1):
            assert re.search(rf"^\[worker \d\] rank {rank}: {label}: median [\d.]+ ms per iteration", done.stdout,
                             re.M), report(done)
    checksums = re.findall(r"^\[worker \d\] rank \d: CHECKSUM ([0-9a-f]{16})$", done.stdout, re.M)
    assert len(checksums) == 4 and len(set(checksums)) == 1, report(done)
