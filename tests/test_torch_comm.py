"""The torch.distributed parts: the order channel (TCP, or gloo when a rank cannot reach rank 0),
and exit safety: gloo's threads never free a Python object at exit.

A gloo thread takes the GIL to free a done-callback it has run and to drop its reference
to a tensor's Python object; if the script has ended by then, the process aborts with
"terminate called without an active exception" (seen in CI, in the DDP hook example).
"""

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from bytescheduler.pytorch.fusion import FusionBuffers
from bytescheduler.pytorch.keeper import Keeper
from tests.distributed import free_port, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_keeper_waits_for_a_callback_that_ran_until_it_is_freed():
    keeper = Keeper()
    seen = []
    future = torch.futures.Future()
    callback = keeper.wrap(seen.append)
    never_run = keeper.wrap(seen.append)  # a callback that never runs is not waited for
    future.add_done_callback(callback)
    assert keeper.wait_idle(0.0)
    future.set_result(1)
    assert len(seen) == 1
    assert not keeper.wait_idle(0.05)  # ran, but we still hold it: not yet freed
    del callback
    assert keeper.wait_idle(1.0)
    del never_run


def _watch_while_work_lives(rank, world_size):
    import torch.distributed as dist

    keeper = Keeper()
    tensor = torch.ones(1000).narrow(0, 0, 500)
    work = dist.all_reduce(tensor, async_op=True)
    keeper.watch(tensor)
    del tensor  # only the work holds it now, and the keeper does not keep it alive
    work.wait()
    idle_while_held = keeper.wait_idle(0.1)
    del work
    idle_after = keeper.wait_idle(5.0)
    return idle_while_held, idle_after


def test_fusion_buffers_are_reused_in_power_of_two_sizes():
    cpu = torch.device("cpu")
    buffers = FusionBuffers()
    first = buffers.take(5000, torch.float32, cpu)
    assert first.numel() == 5000 and first._base.numel() == 8192 and first.storage_offset() == 0
    buffers.give_back(first)
    second = buffers.take(6000, torch.float32, cpu)  # the same size class: the same memory again
    assert second.data_ptr() == first.data_ptr() and second.numel() == 6000
    third = buffers.take(6000, torch.float32, cpu)  # that one is taken: a new buffer
    assert third.data_ptr() != second.data_ptr()
    other = buffers.take(6000, torch.float64, cpu)  # never another dtype's buffer
    assert other.dtype == torch.float64 and other.data_ptr() not in (second.data_ptr(), third.data_ptr())


def test_keeper_waits_until_the_work_lets_go_of_a_tensor():
    [(idle_while_held, idle_after)] = run_ranks(_watch_while_work_lives, 1, deadline=60)
    assert idle_while_held is False and idle_after is True


_ENDS_AT_ONCE = textwrap.dedent(
    """
    import sys, threading, time
    import torch, torch.distributed as dist
    from bytescheduler.core.task import Operation, Piece, Task
    from bytescheduler.pytorch import AllReduceBackend, ProcessGroups

    class SlowToFree:  # lets go of the GIL while it is being freed, like any blocking __del__
        def __del__(self):
            time.sleep(0.3)

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
    backend = AllReduceBackend(ProcessGroups.claim(None, timeout=30.0))
    called = threading.Event()

    def done(error, slow=SlowToFree()):  # only the callback refers to the SlowToFree
        called.set()

    task = Task(key=0, numel=1000, itemsize=4, priority=0, payload=torch.ones(1000))
    backend.launch(Operation([Piece(task, 0, 1000)], 0, 0), done)
    del done, task
    called.wait(30)  # done: end the script while gloo's thread may still be freeing things
    """
)


def test_script_ending_right_after_a_completion_exits_cleanly():
    run = subprocess.run([sys.executable, "-c", _ENDS_AT_ONCE, str(free_port())], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "terminate called" not in run.stderr, (run.returncode, run.stderr[-2000:])


def _schedule_sums(rank, world_size, unreachable_rank):
    import bytescheduler.core.tcp_channel as tcp_channel
    import bytescheduler.pytorch.order as order
    from bytescheduler.core import Scheduler, Task
    from bytescheduler.core.errors import CommunicationError
    from bytescheduler.pytorch import AllReduceBackend, ProcessGroups

    if rank == unreachable_rank:
        def cannot_connect(self, address, token=0, timeout=None):
            raise CommunicationError(f"rank {rank}: no route to {address}")
        order.TcpOrderChannel.join = cannot_connect
    if unreachable_rank == "unresolvable" and rank == 0:
        def unresolvable(peer_host=None):
            raise socket.gaierror(-2, "Name or service not known")
        tcp_channel.local_address = unresolvable  # rank 0 offers 127.0.0.1 instead: fine on one machine
    groups = ProcessGroups.claim(None, timeout=30.0)
    scheduler = Scheduler(AllReduceBackend(groups), channel=groups.order, rank=groups.rank, partition_bytes=256,
                          credit_bytes=512)
    tensors = [torch.full((100,), float((rank + 1) * (key + 1))) for key in range(6)]
    futures = []
    for key, tensor in enumerate(tensors):
        futures.append(scheduler.submit(Task(key=key, numel=100, itemsize=4, priority=-key, payload=tensor,
                                             fuse_key="f32")))
        if rank == 1:
            time.sleep(0.003)  # ready in another rhythm than rank 0: the order must come from rank 0
    for future in futures:
        future.result(timeout=30)
    scheduler.stop()
    tcp = isinstance(groups.order, order.TcpOrderChannel)  # before release, which closes a TCP channel
    groups.release()
    return tcp, [tensor.unique().tolist() for tensor in tensors]


@pytest.mark.parametrize("unreachable_rank", [None, 1, 2, "unresolvable"])
def test_decisions_travel_over_tcp_or_every_rank_falls_back_to_gloo(unreachable_rank):
    outcomes = run_ranks(_schedule_sums, 3, args=(unreachable_rank,), deadline=90)
    expected = [[6.0 * (key + 1)] for key in range(6)]
    assert [sums for _, sums in outcomes] == [expected] * 3
    assert {tcp for tcp, _ in outcomes} == {unreachable_rank not in (1, 2)}
