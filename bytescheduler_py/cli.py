"""The ``bytescheduler`` command.

    bytescheduler demo         2 local ranks: DDP with and without the scheduled hook
    bytescheduler bench-summary  one table of every scheduled system from many bench runs
    bytescheduler microbench   scheduling cost per piece with a no-op backend
    bytescheduler tuner-check  the grid of partition x credit on the testbed, then the tuner from a plan
    bytescheduler simulate     predicted seconds per iteration on any number of ranks and link rate
    bytescheduler calibrate    measure each backend's costs here (fixed, rate, CPU) for the simulator
    bytescheduler plan         the partition and credit to run with (or not to schedule), from the simulator
    bytescheduler sweep        predicted speedups over ranks, rates, partitions and credits; a plot
    bytescheduler mxnet-launch an MXNet parameter-server job on 127.0.0.1 (-n 2 -s 1 -- python train.py)
    bytescheduler soak         long runs of every adapter: RSS, threads, descriptors, sockets stay flat
    bytescheduler chaos        kill or stop a rank at random moments: a clear error, nothing left running
    bytescheduler version
"""

from __future__ import annotations

import sys
from typing import List, Optional

COMMANDS = {
    "demo": "2 local ranks on 127.0.0.1: DDP default vs DDP + scheduled hook",
    "bench": "measure every system on a (bandwidth-limited) 2-rank testbed",
    "bench-summary": "one table of every scheduled system's speedup from many bench runs",
    "microbench": "scheduling cost per piece with a backend that does nothing",
    "tuner-check": "grid of partition x credit on the testbed, then the tuner from a plan: how soon it gets close",
    "simulate": "predict each system's time per iteration for any ranks and link rate",
    "calibrate": "measure each backend's cost per operation and per byte here, for simulate",
    "plan": "recommend partition and credit (or not to schedule) for a model and cluster, from the simulator",
    "sweep": "predicted speedup over ranks, bandwidth, partition and credit, with a plot",
    "mxnet-launch": "run an MXNet parameter-server job (scheduler, servers, workers) on 127.0.0.1",
    "soak": "long 2-rank runs of every adapter: RSS, threads, fds and sockets stay flat",
    "chaos": "kill or stop one rank at random moments: clear errors, every process and port gone",
    "version": "print the version",
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("usage: bytescheduler COMMAND [options]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:<12} {text}")
        print("\n'bytescheduler COMMAND --help' shows a command's options.")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .bench.demo import main as run
    elif command == "bench":
        from .bench.runner import main as run
    elif command == "bench-summary":
        from .bench.summary import main as run
    elif command == "microbench":
        from .bench.microbench import main as run
    elif command == "tuner-check":
        from .bench.tuner_check import main as run
    elif command == "simulate":
        from .sim.cli import main as run
    elif command == "calibrate":
        from .sim.calibrate import main as run
    elif command == "plan":
        from .sim.planner import main as run
    elif command == "sweep":
        from .sim.sweep import main as run
    elif command == "mxnet-launch":
        from .launcher import main as run
    elif command == "soak":
        from .bench.soak import main as run
    elif command == "chaos":
        from .bench.chaos import main as run
    elif command == "version":
        from . import __version__

        print(__version__)
        return 0
    else:
        print(f"bytescheduler: unknown command {command!r}; known: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
