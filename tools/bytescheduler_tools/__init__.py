"""bytescheduler-tools: the benchmark, the demo, the soak and chaos campaigns and the simulator.

A distribution of its own beside the library (``pip install ./tools``; ``make setup`` installs
both), so that a plain ``pip install bytescheduler`` holds the library alone. The tools import
the library; the library imports nothing of theirs: its ``bytescheduler`` command finds their
commands through the ``bytescheduler.commands`` entry point (:mod:`bytescheduler_tools.cli`).

- :mod:`bytescheduler_tools.bench`: ``bench``, ``demo``, ``microbench``, ``tuner-check``,
  ``soak``, ``chaos``, ``bench-summary`` and the synthetic models they train;
- :mod:`bytescheduler_tools.sim`: ``simulate``, ``calibrate``, ``plan``, ``sweep``.
"""
