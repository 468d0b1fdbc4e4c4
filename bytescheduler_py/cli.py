"""The ``bytescheduler`` command.

    bytescheduler mxnet-launch an MXNet parameter-server job on 127.0.0.1 (-n 2 -s 1 -- python train.py)
    bytescheduler version
    bytescheduler COMMAND      a command of an installed plugin (entry point group ``bytescheduler.commands``)

The benchmark, the demo, soak and chaos, and the simulator (``bench``, ``demo``,
``microbench``, ``tuner-check``, ``bench-summary``, ``simulate``, ``calibrate``, ``plan``,
``sweep``, ``soak``, ``chaos``) come with bytescheduler-tools (``pip install ./tools``;
``make setup`` installs it), which registers them in that group: the library imports none of
them.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from typing import Callable, Dict, List, Optional, Tuple

# The library's own commands: name -> (what it does, "module:function").
COMMANDS: Dict[str, Tuple[str, str]] = {
    "mxnet-launch": ("run an MXNet parameter-server job (scheduler, servers, workers) on 127.0.0.1",
                     "bytescheduler.launcher:main"),
}
GROUP = "bytescheduler.commands"
# The commands bytescheduler-tools adds, named in the error when it is not installed.
TOOLS = ("demo", "bench", "bench-summary", "microbench", "compile-check", "tuner-check", "simulate", "calibrate",
         "plan", "sweep", "soak", "chaos")


def _plugins() -> List[metadata.EntryPoint]:
    found = metadata.entry_points()
    if hasattr(found, "select"):  # Python 3.10+
        return list(found.select(group=GROUP))
    return list(found.get(GROUP, ()))  # Python 3.9: a dict of groups


def commands() -> Dict[str, Tuple[str, str]]:
    """Every command: the library's and those of the installed plugins (each a dict like :data:`COMMANDS`)."""
    every = {}
    for entry in _plugins():
        every.update(entry.load())
    every.update(COMMANDS)
    return every


def _function(target: str) -> Callable[[List[str]], int]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known = commands()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("usage: bytescheduler COMMAND [options]\n\ncommands:")
        for name, (text, _) in known.items():
            print(f"  {name:<12} {text}")
        print(f"  {'version':<12} print the version")
        if not any(name in known for name in TOOLS):
            print("\nThe benchmark and simulator commands come with bytescheduler-tools: pip install ./tools")
        print("\n'bytescheduler COMMAND --help' shows a command's options.")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "version":
        from . import __version__

        print(__version__)
        return 0
    if command not in known:
        if command in TOOLS:
            print(f"bytescheduler: {command!r} comes with bytescheduler-tools, which is not installed here: "
                  "pip install ./tools from a checkout (make setup installs it)", file=sys.stderr)
        else:
            print(f"bytescheduler: unknown command {command!r}; known: {', '.join([*known, 'version'])}",
                  file=sys.stderr)
        return 2
    return _function(known[command][1])(rest)


if __name__ == "__main__":
    raise SystemExit(main())
