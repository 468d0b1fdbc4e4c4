"""Tools around the library, not part of it: benchmarks, the demo, the microbenchmark.

- ``bytescheduler bench``: :mod:`~bytescheduler_tools.bench.runner` (testbed, jobs, reports),
  with :mod:`~bytescheduler_tools.bench.worker` / :mod:`~bytescheduler_tools.bench.mxnet_worker`
  running the systems on each rank;
- ``bytescheduler demo``: :mod:`~bytescheduler_tools.bench.demo`;
- ``bytescheduler microbench``: :mod:`~bytescheduler_tools.bench.microbench`;
- ``bytescheduler soak`` and ``bytescheduler chaos``: :mod:`~bytescheduler_tools.bench.soak` and
  :mod:`~bytescheduler_tools.bench.chaos` (long runs; faults at random moments), with
  :mod:`~bytescheduler_tools.bench.jobs` starting 2-rank jobs,
  :mod:`~bytescheduler_tools.bench.torch_trainee` / :mod:`~bytescheduler_tools.bench.mxnet_trainee` training
  on each rank in :mod:`~bytescheduler_tools.bench.rank_loop`'s loop, and
  :mod:`~bytescheduler_tools.bench.procstats` reading ``/proc``;
- :mod:`~bytescheduler_tools.bench.models`: the small synthetic models every tool and example trains.
"""
