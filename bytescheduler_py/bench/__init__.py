"""Tools around the library, not part of it: benchmarks, the demo, the microbenchmark.

- ``bytescheduler bench``: :mod:`~bytescheduler.bench.runner` (testbed, jobs, reports),
  with :mod:`~bytescheduler.bench.worker` / :mod:`~bytescheduler.bench.mxnet_worker`
  running the systems on each rank;
- ``bytescheduler demo``: :mod:`~bytescheduler.bench.demo`;
- ``bytescheduler microbench``: :mod:`~bytescheduler.bench.microbench`;
- ``bytescheduler soak`` and ``bytescheduler chaos``: :mod:`~bytescheduler.bench.soak` and
  :mod:`~bytescheduler.bench.chaos` (long runs; faults at random moments), with
  :mod:`~bytescheduler.bench.jobs` starting 2-rank jobs,
  :mod:`~bytescheduler.bench.torch_trainee` / :mod:`~bytescheduler.bench.mxnet_trainee` training
  on each rank in :mod:`~bytescheduler.bench.rank_loop`'s loop, and
  :mod:`~bytescheduler.bench.procstats` reading ``/proc``;
- :mod:`~bytescheduler.bench.models`: the small synthetic models every tool and example trains.
"""
