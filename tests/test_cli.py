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


def _packages(setup_py) -> set:
    import ast

    tree = ast.parse(setup_py.read_text())
    return set(next(ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                    for k in node.keywords if k.arg == "packages"))


def _found(top, name: str) -> set:
    return {name + ".".join([""] + list(p.parent.relative_to(top).parts)) for p in top.rglob("__init__.py")}


def test_setup_lists_every_package():
    """A wheel carries only the packages setup.py names: a new subpackage must be listed there;
    the library's holds no tool (those are bytescheduler-tools', tools/setup.py)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    assert _packages(root / "setup.py") == _found(root / "bytescheduler_py", "bytescheduler")
    assert not any(".bench" in name or ".sim" in name for name in _packages(root / "setup.py"))
    tools = root / "tools" / "bytescheduler_tools"
    assert _packages(root / "tools" / "setup.py") == _found(tools, "bytescheduler_tools")


def test_the_library_imports_nothing_of_the_tools_and_finds_their_commands_by_entry_point():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    for path in (root / "bytescheduler_py").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) bytescheduler_tools", text, re.M), path
        assert not re.search(r"^\s*from \.+(bench|sim)\b", text, re.M), path
    from bytescheduler.cli import commands

    assert commands()["bench"][1] == "bytescheduler_tools.bench.runner:main"  # registered by tools/setup.py
    # The names the library's error gives when the tools are missing are the tools' commands.
    from bytescheduler.cli import TOOLS
    from bytescheduler_tools.cli import COMMANDS

    assert set(TOOLS) == set(COMMANDS)


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
