"""Tools around the library, not part of it: benchmarks, the demo, the microbenchmark.

- ``bytescheduler bench``: :mod:`~bytescheduler.bench.runner` (testbed, jobs, reports),
  with :mod:`~bytescheduler.bench.worker` / :mod:`~bytescheduler.bench.mxnet_worker`
  running the systems on each rank;
- ``bytescheduler demo``: :mod:`~bytescheduler.bench.demo`;
- ``bytescheduler microbench``: :mod:`~bytescheduler.bench.microbench`;
- :mod:`~bytescheduler.bench.models`: the small synthetic models every tool and example trains.
"""
