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
