"""Errors travel as themselves: the latch keeps the first, re-raising keeps the type, and a
done-callback that raises neither strands other tasks nor escapes into the backend's thread."""

from __future__ import annotations

import threading

import pytest

from bytescheduler.core import ByteSchedulerError, Scheduler, TaskFuture
from tests.fakes import WAIT, FakeBackend, make_task


class OddError(Exception):
    """An exception whose constructor does not take a message (``type(e)(str(e))`` fails)."""

    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")
        self.code = code


def _raise_odd():
    raise OddError(7, "disk full")


def test_reraise_keeps_the_type_the_attributes_and_the_original_traceback():
    from bytescheduler.core.errors import reraise

    try:
        _raise_odd()
    except OddError as error:
        original = error
    with pytest.raises(OddError) as raised:
        reraise(original)
    assert raised.value is not original and raised.value.code == 7 and str(raised.value) == "7: disk full"
    assert raised.value.__cause__ is original
    assert "_raise_odd" in "".join(__import__("traceback").format_tb(original.__traceback__))


def test_reraise_of_an_exception_that_refuses_to_be_copied_raises_the_original():
    from bytescheduler.core.errors import reraise

    class Refuses(Exception):
        def __new__(cls, message, *, token):  # a copy made from the arguments alone is refused
            return super().__new__(cls, message)

        def __init__(self, message, *, token):
            super().__init__(message)

    error = Refuses("no copies", token=1)
    with pytest.raises(Refuses) as raised:
        reraise(error)
    assert raised.value is error


def test_the_latch_keeps_the_first_error_and_remembers_it_was_raised():
    from bytescheduler.core.errors import ErrorLatch

    latch = ErrorLatch()
    latch.raise_if_set()  # nothing yet
    assert latch.set(OddError(1, "first")) and not latch.set(ValueError("second"))
    assert not latch.raised
    for _ in range(2):  # every later call raises it again
        with pytest.raises(OddError, match="first"):
            latch.raise_if_set()
    assert latch.raised


def test_every_callback_runs_when_one_raises_and_the_first_error_is_returned():
    future = TaskFuture()
    seen = []
    future.add_done_callback(lambda f: seen.append("a"))
    future.add_done_callback(lambda f: _raise_odd())
    future.add_done_callback(lambda f: seen.append("c"))
    future.add_done_callback(lambda f: 1 / 0)
    error = future.set_result("done")
    assert seen == ["a", "c"] and isinstance(error, OddError)
    assert future.result(timeout=0) == "done"


def test_a_raising_callback_does_not_strand_the_other_tasks_of_its_operation():
    backend = FakeBackend("manual")
    scheduler = Scheduler(backend, partition_bytes=100, credit_bytes=100)
    try:
        first = scheduler.submit(make_task(0, 10, fuse_key="f32"))
        second = scheduler.submit(make_task(1, 10, priority=1, fuse_key="f32"))
        first.add_done_callback(lambda f: _raise_odd())
        resolved = threading.Event()
        second.add_done_callback(lambda f: resolved.set())
        backend.wait_launched(1)
        records = backend.release_until_done([first, second])
        assert records >= 1 and resolved.wait(WAIT)
        assert second.result(timeout=0).key == 1
        assert backend.callback_errors == []  # nothing escaped into the backend's thread
        with pytest.raises(ByteSchedulerError, match="done-callback of .* raised OddError: 7: disk full") as raised:
            scheduler.check()
        causes = []
        error = raised.value
        while error is not None:
            causes.append(type(error).__name__)
            error = error.__cause__
        assert causes[-1] == "OddError", causes
    finally:
        scheduler.stop(wait=False)
        backend.close()


class _RaisingLaunch:
    """A backend whose launch raises ``error``."""

    def __init__(self, error):
        self.error = error

    def launch(self, op, done):
        raise self.error


def _scheduler_error(backend) -> BaseException:
    scheduler = Scheduler(backend, partition_bytes=100, credit_bytes=100)
    try:
        future = scheduler.submit(make_task(0, 10))
        with pytest.raises(ByteSchedulerError) as raised:
            future.result(timeout=WAIT)
        return raised.value
    finally:
        scheduler.stop(wait=False)


@pytest.mark.parametrize("error", [KeyError("x"), TypeError("bad operand"), AttributeError("no attribute 'y'"),
                                   IndexError("list index out of range"), ValueError("bad value"),
                                   AssertionError("invariant"), ZeroDivisionError("division by zero"),
                                   NameError("name 'z' is not defined"), NotImplementedError("todo")])
def test_a_programming_error_in_a_launch_is_reported_as_itself_not_as_a_dead_peer(error):
    from bytescheduler.core.errors import CommunicationError, InternalError

    raised = _scheduler_error(_RaisingLaunch(error))
    assert isinstance(raised, InternalError) and not isinstance(raised, CommunicationError)
    assert type(error).__name__ in str(raised) and "internal error in bytescheduler" in str(raised)
    assert "peer" not in str(raised)
    assert raised.__cause__ is error


@pytest.mark.parametrize("error", [RuntimeError("Connection closed by peer"), ConnectionResetError("reset"),
                                   OSError("socket closed"), TimeoutError("timed out")])
def test_what_a_communication_backend_raises_is_a_communication_error(error):
    from bytescheduler.core.errors import CommunicationError

    raised = _scheduler_error(_RaisingLaunch(error))
    assert isinstance(raised, CommunicationError)
    assert "a peer process may have died" in str(raised) and str(error) in str(raised)
    assert raised.__cause__ is error


def test_a_backend_error_of_a_runtime_error_subclass_is_a_communication_error():
    """torch's DistBackendError, Horovod's HorovodInternalError and MXNet's MXNetError are RuntimeErrors."""
    from bytescheduler.core.errors import CommunicationError, as_library_error

    class HorovodInternalError(RuntimeError):
        pass

    class MXNetError(RuntimeError):
        pass

    import torch.distributed as dist

    for error in (HorovodInternalError("Horovod has been shut down"), MXNetError("kvstore failed"),
                  dist.DistBackendError("NCCL error")):
        assert isinstance(as_library_error(error, 0), CommunicationError), error
    closed = ByteSchedulerError("closed")
    assert as_library_error(closed, 0) is closed
