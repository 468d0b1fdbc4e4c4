"""Settings that differ between ranks, and models that differ, on 2 real gloo processes.

Every setting is given on one rank only (as an environment variable, the way one node's job
script or one container's image differs). Shared settings come from rank 0, with a warning
on the rank whose value differed; the timeline and debug level stay each rank's own; the
numbers stay DDP's. A model that differs is refused on every rank, naming the parameter.
Horovod's twin is in tests/test_horovod.py (``settings`` and ``layout`` scenarios).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed import run_ranks

STEPS = 12
# One rank's environment (the other rank sets none of these).
ONE_RANK = {
    "BYTESCHEDULER_TIMEOUT": "45",
    "BYTESCHEDULER_PARTITION": "8KiB",
    "BYTESCHEDULER_CREDIT": "32KiB",
    "BYTESCHEDULER_MERGE": "0",
    "BYTESCHEDULER_FAST_LANE": "0",
    "BYTESCHEDULER_CYCLE_TIME": "7",
    "BYTESCHEDULER_TUNING": "1",
    "BYTESCHEDULER_ADAPTIVE": "0",
    "BYTESCHEDULER_DEBUG": "INFO",
}
SHARED = ("timeout", "partition_bytes", "credit_bytes", "merge", "fast_lane_bytes", "cycle_ms", "auto_tune",
          "adaptive")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 64), nn.ReLU(), nn.Linear(64, 10))


def _with_settings_on(rank, world_size, configured, adapter, tmp):
    """Rank ``configured`` sets every variable of ONE_RANK (and a timeline path); train with
    ``adapter`` against DDP side by side; return the effective settings, warnings, equality."""
    import bytescheduler.pytorch as bsp
    from torch.nn.parallel import DistributedDataParallel as DDP

    if rank == configured:
        os.environ.update(ONE_RANK, BYTESCHEDULER_TIMELINE=os.path.join(tmp, "trace.json"))
    records = _Records()
    logging.getLogger("bytescheduler").addHandler(records)
    theirs = DDP(_model())
    if adapter == "optimizer":
        ours = _model()
        optimizer = bsp.ScheduledOptimizer(ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9))
        scheduler = optimizer._bytescheduler.scheduler
        compare = ours
    else:
        ours = DDP(_model())
        state = bsp.ScheduledHookState(model=ours.module)
        ours.register_comm_hook(state, bsp.scheduled_allreduce_hook)
        optimizer = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
        scheduler = state.scheduler
        compare = ours.module
    config = scheduler.config  # as agreed (rank 0's tuner changes its own later)
    effective = {field: getattr(config, field) for field in SHARED + ("timeline", "log_level")}
    baseline = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 3, 8, 8, generator=data), torch.randint(0, 10, (8,), generator=data)
        for model, opt in ((ours, optimizer), (theirs, baseline)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    if adapter == "optimizer":
        optimizer.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(compare.parameters(), theirs.module.parameters()))
    if adapter == "optimizer":
        optimizer.close()
    else:
        state.close()
    logging.getLogger("bytescheduler").removeHandler(records)
    return dict(same=same, effective=effective, warnings=[m for m in records.messages if "rank 0's" in m])


@pytest.mark.parametrize("adapter", ["optimizer", "hook"])
@pytest.mark.parametrize("configured", [1, 0])
def test_settings_on_one_rank_only_come_from_rank_0_and_the_numbers_stay_ddps(adapter, configured, tmp_path):
    ranks = run_ranks(_with_settings_on, 2, (configured, adapter, str(tmp_path)), deadline=120)
    leader, follower = ranks
    for run in ranks:
        assert run["same"], run
    # Shared settings: both ranks run with rank 0's values.
    assert {f: leader["effective"][f] for f in SHARED} == {f: follower["effective"][f] for f in SHARED}
    if configured == 0:
        assert leader["effective"]["timeout"] == 45.0 and leader["effective"]["partition_bytes"] == 8192
    else:
        assert follower["effective"]["timeout"] != 45.0 and not follower["effective"]["auto_tune"]
        # The rank whose values were overridden says which, naming the variable and both values.
        text = "\n".join(follower["warnings"])
        for variable in ("BYTESCHEDULER_TIMEOUT", "BYTESCHEDULER_PARTITION", "BYTESCHEDULER_ADAPTIVE",
                         "BYTESCHEDULER_TUNING", "BYTESCHEDULER_CYCLE_TIME"):
            assert variable in text, text
        assert "rank 1: timeout (BYTESCHEDULER_TIMEOUT) is 45.0 here (from the environment) but 300.0 on rank 0" in text, text
    # Each rank's own: the timeline and the debug level of the configured rank only.
    configured_rank, other = ranks[configured], ranks[1 - configured]
    assert configured_rank["effective"]["timeline"].endswith("trace.json") and other["effective"]["timeline"] is None
    assert configured_rank["effective"]["log_level"] == logging.INFO and other["effective"]["log_level"] is None


class _Shaped(nn.Module):
    def __init__(self, rank, case):
        super().__init__()
        self.first = nn.Linear(4, 8)
        width = 3 if (case == "shape" and rank == 1) else 2
        self.second = nn.Linear(8, width) if not (case == "name" and rank == 1) else None
        if case == "name" and rank == 1:
            self.renamed = nn.Linear(8, 2)
        if case == "count" and rank == 1:
            self.extra = nn.Linear(2, 2)
        if case == "dtype" and rank == 1:
            self.second.double()
        if case == "sparse":
            self.embedding = nn.Embedding(10, 4, sparse=rank == 1)


def _mismatched(rank, world_size, adapter):
    """Every case in turn on the same processes (a refused model claims no process group)."""
    import bytescheduler.pytorch as bsp
    from bytescheduler.core.agreement import LayoutMismatch

    messages = {}
    for case in CASES:
        model = _Shaped(rank, case)
        try:
            if adapter == "optimizer":
                bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
            else:
                bsp.ScheduledHookState(model=model)
        except LayoutMismatch as error:
            messages[case] = str(error)
        else:
            messages[case] = "no error"
    return messages


CASES = {
    "shape": "'second.weight' of shape (2, 8), float32 on rank 0 but 'second.weight' of shape (3, 8), float32 on rank 1",
    "name": "'second.weight' of shape (2, 8), float32 on rank 0 but 'renamed.weight' of shape (2, 8), float32 on rank 1",
    "count": "rank 0 has 4 parameters, rank 1 has 6; rank 1 has 'extra.weight'",
    "dtype": "'second.weight' of shape (2, 8), float32 on rank 0 but 'second.weight' of shape (2, 8), float64",
    "sparse": "'embedding.weight' of shape (10, 4), float32 on rank 0 but 'embedding.weight' of shape (10, 4), "
              "float32, sparse on rank 1",
}


@pytest.mark.parametrize("adapter", ["optimizer", "hook"])
def test_a_model_that_differs_is_refused_on_every_rank_naming_the_parameter(adapter):
    for messages in run_ranks(_mismatched, 2, (adapter,), deadline=60):
        for case, expected in CASES.items():
            assert expected in messages[case], (case, messages[case])
