"""The command line: ``bytescheduler`` and ``python -m bytescheduler`` are the same program."""

import subprocess
import sys

import bytescheduler


def _run(*args):
    return subprocess.run([sys.executable, "-m", "bytescheduler", *args], capture_output=True, text=True, timeout=60)


def test_python_dash_m_lists_every_command():
    run = _run("--help")
    assert run.returncode == 0, run.stderr
    for command in ("demo", "bench", "microbench", "mxnet-launch", "version"):
        assert f"  {command} " in run.stdout


def test_python_dash_m_runs_a_command_and_refuses_unknown_ones():
    assert _run("version").stdout.strip() == bytescheduler.__version__
    unknown = _run("frobnicate")
    assert unknown.returncode == 2 and "unknown command 'frobnicate'" in unknown.stderr
    assert _run().returncode == 2  # no command: usage, and a usage error


def test_setup_lists_every_package():
    """A wheel carries only the packages setup.py names: a new subpackage must be listed there."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "setup.py").read_text())
    listed = next(ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for k in node.keywords if k.arg == "packages")
    found = {"bytescheduler" + ".".join([""] + list(p.parent.relative_to(root / "bytescheduler_py").parts))
             for p in (root / "bytescheduler_py").rglob("__init__.py")}
    assert set(listed) == found


def test_bench_summary_tabulates_runs_and_marks_systems_slower_than_their_baseline(tmp_path):
    import json

    def entry(label, median, blocks, baseline=None, speedup=None, plain=None):
        return {"label": label, "median_s": median, "blocks_s": blocks, "baseline": baseline, "speedup": speedup,
                "attainable_gain": None if speedup is None else 0.5,
                "profile_per_rank": [{"plain_fraction": plain}]}

    run = {"model": "vgg", "network": "2 network namespaces, veth links shaped to 1gbit each way (tbf)",
           "systems": {"ddp": entry("DDP default", 1.2, [1.2, 1.2]),
                       "scheduled": entry("ScheduledOptimizer", 1.0, [1.0, 1.1], "ddp", 1.2, 0.0),
                       "ddp-hook": entry("DDP + scheduled hook", 1.25, [1.25, 1.2], "ddp", 0.96)}}
    (tmp_path / "results.json").write_text(json.dumps(run))
    out = _run("bench-summary", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "| vgg | 1 Gbit/s | ScheduledOptimizer | 1.000 / 1.200 | 1.20x | 1.15 (1.09-1.20) | 50% | 0% |" in lines
    assert "| vgg | 1 Gbit/s | DDP + scheduled hook | 1.250 / 1.200 | 0.96x (slower) | 0.98 (0.96-1.00) | 50% |  |" in lines
    assert "1 of 2 rows below 1.00x" in out.stdout
