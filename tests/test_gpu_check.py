"""scripts/gpu_check.sh's dry run (--cpu): the GPU check's every step on CPU tensors, so that
the script a GPU machine runs cannot rot (issue: the CUDA path has never run here)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_the_gpu_checks_dry_run_passes_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--cpu", str(out)],
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    checks = {(row["check"], row["where"]) for row in results["rows"]}
    assert len(checks) == 17 and all(row["ok"] for row in results["rows"]), results["rows"]
    assert {"torch.compile, ScheduledOptimizer", "DDP hook, scheduled", "timeline written"} <= {c for c, _ in checks}
    assert [row["model"] for row in results["costs"]] == ["small", "large"]
    assert all(row["ddp_ms"] > 0 and row["scheduled_ms"] > 0 for row in results["costs"])
    assert not results["bytescheduler"].startswith(ROOT), results["bytescheduler"]  # the installed copy ran
    table = (out / "table.md").read_text()
    assert "| ScheduledOptimizer, scheduled path | 2 ranks, gloo, cpu, rank 1 | ok | bit for bit |" in table
