"""How the Horovod adapter waits for an operation: never letting the core idle on Horovod's own path.

Horovod's ``synchronize`` polls between yields and never sleeps; sleeping lets the VM's core
idle and costs the wake-up (8% of an MLP iteration at
2 Gbit/s, where one all-reduce lasts longer than the 50 ms our other waits spin). Our bucket
reducer's waits spin the same way (Horovod's ``poll`` replaced by a clock here); on Horovod's
own hooks its ``synchronize`` itself runs, on a thread of ours, while the training thread keeps
the deadline (a fake ``DistributedOptimizer`` here). The real Horovod runs in
tests/test_horovod.py.
"""

import threading
import time

import pytest
import torch

from bytescheduler.core.errors import CommunicationError, CommunicationTimeout
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
    """What HorovodHooks reads of an hvd.DistributedOptimizer: its handles and its synchronize
    (which waits on ``release`` when given, as Horovod's waits for a stalled peer; raises
    ``error`` when given)."""

    def __init__(self, handles, release=None, error=None):
        self._handles = handles
        self.release = release
        self.error = error
        self.threads = []
        self.returned = 0

    def synchronize(self):
        self.threads.append(threading.current_thread())
        if self.release is not None:
            self.release.wait()
        self.returned += 1
        if self.error is not None:
            raise self.error


@pytest.fixture
def rank0(monkeypatch):
    monkeypatch.setattr(adapter.hvd, "rank", lambda: 0)


def _hooks(optimizer, timeout=30.0):
    return adapter.HorovodHooks(optimizer, passes=1, timeout=timeout)


def test_horovods_own_hooks_are_finished_by_its_synchronize_on_a_thread_of_its_own(rank0):
    """synchronize waits in Horovod's C++ loop, the GIL released, not in ours."""
    optimizer = _FakeDistributedOptimizer({"weight": (1, None)})
    hooks = _hooks(optimizer)
    hooks.finish()
    hooks.finish()
    (thread,) = set(optimizer.threads)
    assert len(optimizer.threads) == 2 and thread is not threading.current_thread()
    assert thread.name == "bytescheduler-hvd-sync-r0" and thread.is_alive()
    hooks.close()
    assert not thread.is_alive()


def test_horovods_own_hooks_keep_our_deadline_and_then_refuse_at_once(rank0):
    release = threading.Event()  # a peer stopped: synchronize does not return
    optimizer = _FakeDistributedOptimizer({"weight": (1, None)}, release=release)
    hooks = _hooks(optimizer, timeout=0.2)
    started = time.monotonic()
    with pytest.raises(CommunicationTimeout, match="all-reduce of Horovod's own path did not finish within 0.2 s"):
        hooks.finish()
    assert 0.2 <= time.monotonic() - started < 2.0
    started = time.monotonic()
    with pytest.raises(CommunicationTimeout, match="still waiting for an earlier one"):
        hooks.finish()
    assert time.monotonic() - started < 0.1  # not a second full timeout
    hooks.close()  # the thread is still in synchronize: left to end with the process
    (thread,) = set(optimizer.threads)
    assert thread.is_alive()
    optimizer.release = None
    release.set()  # the peer came back: the late call ends, and the next one runs again
    deadline = time.monotonic() + 5
    while True:  # refused at once until the late call has returned
        try:
            hooks.finish()
            break
        except CommunicationTimeout:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert optimizer.threads == [thread, thread] and optimizer.returned == 2
    hooks.close()


def test_a_failed_synchronize_is_raised_on_the_training_thread_once(rank0):
    optimizer = _FakeDistributedOptimizer({"weight": (1, None)}, error=RuntimeError("Horovod has been shut down"))
    hooks = _hooks(optimizer)
    with pytest.raises(CommunicationError, match="rank 0: communication failed .*Horovod has been shut down") as caught:
        hooks.finish()
    assert isinstance(caught.value.__cause__, RuntimeError)
    optimizer.error = None
    hooks.finish()  # the error was this call's, not the next one's
    hooks.close()


def test_closing_on_horovods_own_hooks_with_nothing_launched_does_not_synchronize(rank0):
    optimizer = _FakeDistributedOptimizer({"weight": (None, None)})
    hooks = _hooks(optimizer)
    hooks.finish(launched_only=True)
    assert optimizer.threads == []  # synchronize would all-reduce every parameter
    hooks.close()
