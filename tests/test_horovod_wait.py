"""How the Horovod adapter waits for an operation: never sleeping on Horovod's own path.

Horovod's ``synchronize`` polls between yields and never sleeps; sleeping lets the VM's core
idle and costs the wake-up (docs/benchmarks.md, tenth round: 8% of an MLP iteration at
2 Gbit/s, where one all-reduce lasts longer than the 50 ms our other waits spin). These
tests drive the wait with Horovod's ``poll`` replaced by a clock, in this process (the real
Horovod runs in tests/test_horovod.py).
"""

import time

import pytest
import torch

from bytescheduler.core.errors import CommunicationTimeout
from bytescheduler.pytorch import horovod as adapter  # Horovod is installed by the set-up: no skip
from bytescheduler.pytorch.horovod_hold import Held

LONG = 0.15  # longer than the spin of the other waits (adapter._SPIN_SECONDS)


@pytest.fixture
def clock(monkeypatch):
    """Handles finish ``LONG`` s after the first poll; counts the adapter's sleeps.

    From the first poll, not from the fixture: on a busy machine the test may start tens of
    milliseconds after the fixture, and the wait would then be shorter than ``LONG``.
    """
    done_at = []
    sleeps = []
    real_sleep = time.sleep

    def sleep(seconds):
        sleeps.append(seconds)
        real_sleep(seconds)

    def poll(handle):
        if not done_at:
            done_at.append(time.monotonic() + LONG)
        return time.monotonic() >= done_at[0]

    monkeypatch.setattr(adapter.hvd, "poll", poll)
    monkeypatch.setattr(adapter.hvd, "synchronize", lambda handle: None)
    monkeypatch.setattr(adapter.time, "sleep", sleep)
    return sleeps


def test_horovods_own_path_waits_without_sleeping_however_long(clock):
    assert LONG > adapter._SPIN_SECONDS
    reducer = adapter.HorovodReducer("test", timeout=30.0)
    started = time.monotonic()
    reducer.wait([(Held(torch.zeros(4)), 1), (Held(torch.zeros(4)), 2)])
    assert time.monotonic() - started >= LONG * 0.9
    assert clock == []


def test_other_waits_spin_then_sleep(clock):
    adapter._wait_for(1, None, 30.0, "a test wait", Held(torch.zeros(4)))
    assert clock and max(clock) <= 1e-3


def test_the_spinning_wait_still_keeps_its_deadline(monkeypatch):
    monkeypatch.setattr(adapter.hvd, "poll", lambda handle: False)
    monkeypatch.setattr(adapter.hvd, "rank", lambda: 0)
    reducer = adapter.HorovodReducer("test", timeout=0.1)
    started = time.monotonic()
    with pytest.raises(CommunicationTimeout, match="all-reduce of Horovod's own path did not finish within 0.1 s"):
        reducer.wait([(Held(torch.zeros(4)), 1)])
    assert time.monotonic() - started < 2.0


class _FakeDistributedOptimizer:
    """What HorovodHooks reads of an hvd.DistributedOptimizer: its handles, the parameters it
    averages, its launch of one all-reduce and synchronize."""

    def __init__(self, handles, requires=None):
        self._handles = handles
        self._requires_update = set(handles if requires is None else requires)
        self.synchronized = 0
        self.launched = []

    def _allreduce_grad_async(self, param):
        self.launched.append(param)
        return 100 + len(self.launched), None

    def synchronize(self):
        self.synchronized += 1


def test_horovods_own_hooks_are_finished_by_its_synchronize_after_our_spinning_wait(clock):
    optimizer = _FakeDistributedOptimizer({"weight": (1, None), "bias": (2, None), "unused": (None, None)})
    hooks = adapter.HorovodHooks(optimizer, passes=1, timeout=30.0)
    started = time.monotonic()
    hooks.finish()
    assert time.monotonic() - started >= LONG * 0.9  # waited for the launched all-reduces first
    assert optimizer.synchronized == 1 and clock == []  # then Horovod's own synchronize; no sleep
    assert optimizer.launched == ["unused"]  # launched as synchronize would, then waited for


def test_a_parameter_without_a_gradient_is_waited_for_with_our_deadline_too(monkeypatch):
    """Horovod's synchronize launches an all-reduce for a parameter whose hook did not run and
    waits for it without a deadline: launched first, its wait keeps ours."""
    monkeypatch.setattr(adapter.hvd, "poll", lambda handle: handle < 100)  # only the late launch stalls
    monkeypatch.setattr(adapter.hvd, "rank", lambda: 0)
    optimizer = _FakeDistributedOptimizer({"weight": (1, None)}, requires=["weight", "no-gradient"])
    started = time.monotonic()
    with pytest.raises(CommunicationTimeout, match="all-reduce of Horovod's own path did not finish within 0.1 s"):
        adapter.HorovodHooks(optimizer, passes=1, timeout=0.1).finish()
    assert time.monotonic() - started < 2.0
    assert optimizer.launched == ["no-gradient"] and optimizer.synchronized == 0


def test_horovods_own_hooks_keep_our_deadline_and_never_reach_synchronize(monkeypatch):
    monkeypatch.setattr(adapter.hvd, "poll", lambda handle: False)  # a peer stopped
    monkeypatch.setattr(adapter.hvd, "rank", lambda: 0)
    optimizer = _FakeDistributedOptimizer({"weight": (1, None)})
    started = time.monotonic()
    with pytest.raises(CommunicationTimeout, match="all-reduce of Horovod's own path did not finish within 0.1 s"):
        adapter.HorovodHooks(optimizer, passes=1, timeout=0.1).finish()
    assert time.monotonic() - started < 2.0 and optimizer.synchronized == 0


def test_closing_on_horovods_own_hooks_with_nothing_launched_does_not_synchronize(clock):
    optimizer = _FakeDistributedOptimizer({"weight": (None, None)})
    adapter.HorovodHooks(optimizer, passes=1, timeout=30.0).finish(launched_only=True)
    assert optimizer.synchronized == 0  # synchronize would all-reduce every parameter
