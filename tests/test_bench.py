"""The benchmark's testbed and runner, for real: namespaces, shaping, reports, teardown."""

import json
import os
import subprocess
import sys

import pytest

from bytescheduler.bench.testbed import NamespaceTestbed, make_testbed, namespaces_available


def _namespaces():
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_namespaces_are_available_here():
    # CI runs as root with iproute2: the benchmark must not silently fall back to loopback there.
    assert namespaces_available() is None


def test_testbed_builds_a_shaped_star_and_tears_it_down():
    before = _namespaces()
    with NamespaceTestbed(2, "500mbit") as net:
        made = _namespaces() - before
        assert made == {net.hub, *net.names}
        shown = subprocess.run(net.wrap(0, ["tc", "qdisc", "show", "dev", "v0"]), capture_output=True, text=True)
        assert "tbf" in shown.stdout and "500Mbit" in shown.stdout
        reach = subprocess.run(
            net.wrap(1, [sys.executable, "-c",
                         "import socket; s = socket.socket(); s.bind(('10.99.0.2', 0)); print('ok')"]),
            capture_output=True, text=True, timeout=30,
        )
        assert reach.stdout.strip() == "ok", reach.stderr
    assert _namespaces() == before


def test_bad_rate_is_a_clear_error_and_leaves_nothing():
    before = _namespaces()
    with pytest.raises(ValueError, match="1gbit"):
        make_testbed(2, "fast")
    assert _namespaces() == before


def test_bench_on_a_1gbit_testbed_writes_every_report(tmp_path):
    before = _namespaces()
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "bytescheduler.cli", "bench", "--bandwidth", "1gbit", "--model", "tiny",
         "--batch-size", "8", "--systems", "compute", "comm", "ddp", "ddp-hook", "scheduled",
         "--rounds", "2", "--iters", "1", "--warmup", "1", "--out", str(out), "--deadline", "300"],
        capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _namespaces() == before  # torn down
    assert "| ScheduledOptimizer |" in done.stdout and "vs DDP default" in done.stdout
    summary = json.loads((out / "results.json").read_text())
    assert set(summary["systems"]) == {"compute", "comm", "ddp", "ddp-hook", "scheduled"}
    # The link is shaped: a large all-reduce moves at most ~1 Gbit/s per direction.
    assert summary["link_bytes_per_s"] * 8 < 1.1e9
    assert "namespaces" in summary["network"]
    assert summary["systems"]["scheduled"]["scheduler"]["operations"] > 0
    for name in ("results.md", "speed.png", "timeline-scheduled.png", "timeline-ddp.png"):
        assert (out / name).stat().st_size > 0, name


def test_bench_failure_is_reported_and_cleans_up(tmp_path):
    before = _namespaces()
    done = subprocess.run(
        [sys.executable, "-m", "bytescheduler.cli", "bench", "--bandwidth", "1gbit", "--model", "tiny",
         "--rounds", "1", "--iters", "1", "--warmup", "1", "--partition", "not-a-size", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1
    assert "partition_bytes" in done.stderr and "failed" in done.stderr
    assert _namespaces() == before
