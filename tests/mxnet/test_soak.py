"""ScheduledKVStore stays flat over 2,000 steps: ``bytescheduler soak --adapters mxnet``.

Two workers, one server and a scheduler under ``bytescheduler mxnet-launch``; the workers
sample RSS, threads, descriptors and sockets every 50 steps and must stay flat after the
warm-up (the checks of tests/test_soak.py, from tests/reliability.py).
"""

from tests.reliability import check_flat, no_caller_settings, run_soak  # noqa: F401 - autouse fixture


def test_every_worker_stays_flat_over_2000_steps(tmp_path):
    """The store as users get it: the mode switch on."""
    check_flat(run_soak(tmp_path, "mxnet"))


def test_every_worker_stays_flat_over_2000_scheduled_steps(tmp_path):
    """The mode switch off: every push and pull through the scheduler."""
    check_flat(run_soak(tmp_path, "mxnet", "--schedule-only"), fixed=True)
