"""The tools' commands, for the library's ``bytescheduler`` command (entry point group
``bytescheduler.commands``, name ``tools``): name -> (what it does, ``module:function``).
Each function takes the command's arguments (a list of strings) and returns an exit code."""

COMMANDS = {
    "demo": ("2 local ranks on 127.0.0.1: DDP default vs DDP + scheduled hook", "bytescheduler_tools.bench.demo:main"),
    "bench": ("measure every system on a (bandwidth-limited) 2-rank testbed", "bytescheduler_tools.bench.runner:main"),
    "bench-summary": ("one table of every scheduled system's speedup from many bench runs",
                      "bytescheduler_tools.bench.summary:main"),
    "compile-check": ("torch.compile with each adapter on 2 local ranks: time per step, recompiles, numbers",
                      "bytescheduler_tools.bench.compile_check:main"),
    "microbench": ("scheduling cost per piece with a backend that does nothing",
                   "bytescheduler_tools.bench.microbench:main"),
    "tuner-check": ("grid of partition x credit on the testbed, then the tuner from a plan: how soon it gets close",
                    "bytescheduler_tools.bench.tuner_check:main"),
    "simulate": ("predict each system's time per iteration for any ranks and link rate",
                 "bytescheduler_tools.sim.cli:main"),
    "calibrate": ("measure each backend's cost per operation and per byte here, for simulate",
                  "bytescheduler_tools.sim.calibrate:main"),
    "plan": ("recommend partition and credit (or not to schedule) for a model and cluster, from the simulator",
             "bytescheduler_tools.sim.planner:main"),
    "sweep": ("predicted speedup over ranks, bandwidth, partition and credit, with a plot",
              "bytescheduler_tools.sim.sweep:main"),
    "soak": ("long 2-rank runs of every adapter: RSS, threads, fds and sockets stay flat",
             "bytescheduler_tools.bench.soak:main"),
    "chaos": ("kill or stop one rank at random moments: clear errors, every process and port gone",
              "bytescheduler_tools.bench.chaos:main"),
}
