"""The multi-process test harness itself: when a rank fails, the report carries what the
other ranks said or how they died, since one rank's error is often the echo of another's."""

from __future__ import annotations

import os
import time

import pytest

from tests.distributed import RanksFailed, run_ranks


def _root_and_echo(rank, world_size):
    if rank == 0:
        time.sleep(0.5)  # the echo arrives first, as gloo's "connection closed" does
        raise ValueError("the root cause on rank 0")
    raise RuntimeError("an echo on rank 1")


def _crash_and_echo(rank, world_size, echo_after):
    import torch.distributed as dist

    # Rank 0 hosts the rendezvous store: dying before rank 1 finished joining the group made
    # rank 1 fail inside init_process_group instead of echoing (a slow machine, 2026-11-29).
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.wait(["rank 1 joined"])
        os._exit(7)  # dies in native code: no traceback reaches the queue
    store.set("rank 1 joined", "1")
    time.sleep(echo_after)
    raise RuntimeError("an echo on rank 1")


def test_a_failed_run_reports_every_rank_that_failed():
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_root_and_echo, 2, deadline=60)
    report = str(failed.value)
    assert "rank 1 failed" in report and "an echo on rank 1" in report
    assert "rank 0 failed" in report and "the root cause on rank 0" in report


# The echo before the harness sees the death (its queue read times out after 1 s), or after.
@pytest.mark.parametrize("echo_after", [0.2, 2.5])
def test_a_failed_run_names_a_rank_that_died_without_a_report(echo_after):
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_crash_and_echo, 2, (echo_after,), deadline=60)
    report = str(failed.value)
    assert "an echo on rank 1" in report and ("rank 0: process exited with code 7" in report
                                              or "rank 0 exited with code 7" in report), report
