"""Sparse gradients (nn.EmbeddingBag(sparse=True), as recommendation models use them) on 2 real
gloo processes: the hook and ScheduledOptimizer give DDP's numbers bit for bit, on the
scheduled path and while the mode switch alternates paths, with accumulation too."""

from __future__ import annotations

import os
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed import run_ranks

STEPS = 20
SHORT = dict(warmup=2, settle=1, trial=2, pairs=2, hold=3, trial_seconds=0, clear_hold=1, min_retrial=2, predict=False)


class _Recommender(nn.Module):
    """Bags of item ids -> a sparse embedding -> a dense head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.items = nn.EmbeddingBag(500, 16, mode="sum", sparse=True)
        self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, ids):
        return self.head(self.items(ids))


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.Adagrad(params, lr=0.05)


def _batches(rank):
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        # Most ids differ between the ranks; a few are shared (duplicates within a bag too).
        yield torch.randint(0, 500, (8, 6), generator=data), torch.randint(0, 4, (8,), generator=data)


def _differences(ours, theirs):
    return [name for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters())
            if not torch.equal(a, b)]


def _hook(rank, world_size, adaptive, kind):
    import bytescheduler.pytorch as bsp
    from bytescheduler.core import modes
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["BYTESCHEDULER_MODE_SWITCH"] = modes.ModeSwitchParams(**SHORT).text()
    theirs, ours = DDP(_Recommender()), DDP(_Recommender())
    state = bsp.ScheduledHookState(adaptive=adaptive, partition_bytes="1KiB", credit_bytes="4KiB")
    ours.register_comm_hook(state, bsp.scheduled_allreduce_hook)
    optimizers = [_optimizer(kind, m.parameters()) for m in (ours, theirs)]
    for ids, y in _batches(rank):
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad()
            F.cross_entropy(model(ids), y).backward()
            optimizer.step()
    modes_run = "" if state.driver is None else "".join(m[0] for m in state.driver.chooser.history)
    state.close()
    return dict(differences=_differences(ours.module, theirs.module), modes=modes_run)


def _optimizer_case(rank, world_size, adaptive, kind, passes):
    import bytescheduler.pytorch as bsp
    from bytescheduler.core import modes
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["BYTESCHEDULER_MODE_SWITCH"] = modes.ModeSwitchParams(**SHORT).text()
    theirs, ours = DDP(_Recommender()), _Recommender()
    baseline = _optimizer(kind, theirs.parameters())
    optimizer = bsp.ScheduledOptimizer(ours, _optimizer(kind, ours.parameters()), adaptive=adaptive,
                                       backward_passes_per_step=passes, partition_bytes="1KiB", credit_bytes="4KiB")
    batches = list(_batches(rank))
    for step in range(0, STEPS, passes):
        for opt in (optimizer, baseline):
            opt.zero_grad()
        for micro, (ids, y) in enumerate(batches[step:step + passes]):
            (F.cross_entropy(ours(ids), y) / passes).backward()
            if micro < passes - 1:
                with theirs.no_sync():
                    (F.cross_entropy(theirs(ids), y) / passes).backward()
            else:
                (F.cross_entropy(theirs(ids), y) / passes).backward()
        optimizer.step()
        baseline.step()
    optimizer.synchronize()
    chooser = optimizer._bytescheduler.chooser
    modes_run = "" if chooser is None else "".join(m[0] for m in chooser.history)
    optimizer.close()
    return dict(differences=_differences(ours, theirs.module), modes=modes_run)


def _check(runs, adaptive):
    for run in runs:
        assert run["differences"] == [], run
    if adaptive:
        assert runs[0]["modes"] == runs[1]["modes"] and "p" in runs[0]["modes"] and "s" in runs[0]["modes"], runs


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_the_hook_averages_sparse_gradients_as_ddp_does(adaptive, kind):
    _check(run_ranks(_hook, 2, (adaptive, kind), deadline=120), adaptive)


@pytest.mark.parametrize("adaptive,kind,passes", [(False, "sgd", 1), (True, "adagrad", 1), (False, "adagrad", 2)])
def test_scheduled_optimizer_averages_sparse_gradients_as_ddp_does(adaptive, kind, passes):
    _check(run_ranks(_optimizer_case, 2, (adaptive, kind, passes), deadline=120), adaptive)
