"""Averaged gradients handed over as views of the buffer they were averaged in (``grad_views``).

The DDP hook makes each large gradient a view of its DDP bucket, so DDP's copy back is a
no-op; ScheduledOptimizer's plain path does the same with its own flat buffers instead of
copying back. Either way the numbers must be DDP's own (its built-in path, no hook), bit for
bit on 2 ranks, whether the user sets gradients to None between steps or zeroes them in
place (then backward accumulates straight into the views), with accumulation under
``no_sync`` and across DDP's bucket rebuild after the first iteration.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bytescheduler.pytorch.grad_views import MIN_VIEW_BYTES, BucketViews, can_view, hand_over
from tests.distributed import run_ranks

STEPS = 24
SHORT = dict(warmup=2, settle=1, trial=2, pairs=2, hold=3, trial_seconds=0, clear_hold=1, min_retrial=2)


def test_a_view_is_handed_over_only_where_it_saves_a_copy_and_is_laid_out_alike():
    big = nn.Parameter(torch.zeros(64, 1024))  # 256 KiB
    buffer = torch.zeros(2 * 64 * 1024)
    view = buffer[64 * 1024:].view(64, 1024)
    assert can_view(big, view)
    assert not can_view(big, buffer[:64 * 1024].view(1024, 64))  # another shape
    assert not can_view(big, buffer[:64 * 1024].view(64, 1024).t().contiguous().t())  # another layout
    small = nn.Parameter(torch.zeros(4, 4))
    assert not can_view(small, torch.zeros(16).view(4, 4))  # a copy is cheaper
    assert can_view(small, torch.zeros(16).view(4, 4), min_bytes=0)
    assert not hand_over(big, view)  # no gradient: nothing to replace
    big.grad = torch.ones(64, 1024)
    assert hand_over(big, view) and big.grad is view and not hand_over(big, view)  # once is enough
    big.grad = torch.ones(64, 1024).to_sparse()
    assert not hand_over(big, view) and big.grad.is_sparse


class _Net(nn.Module):
    """Large layers (their gradients become views) beside small ones (copied)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(48, 256)    # 48 KiB weight: below the threshold
        self.mid = nn.Linear(256, 256)   # 256 KiB
        self.mid2 = nn.Linear(256, 256)  # 256 KiB
        self.out = nn.Linear(256, 10)

    def forward(self, x):
        return self.out(torch.tanh(self.mid2(torch.tanh(self.mid(torch.tanh(self.inp(x)))))))


LARGE = ("mid.weight", "mid2.weight")


def _shares_storage(model):
    """Whether the large layers' gradients live in one buffer (views of it)."""
    grads = [dict(model.named_parameters())[name].grad for name in LARGE]
    return grads[0].untyped_storage().data_ptr() == grads[1].untyped_storage().data_ptr()


def _same(ours, theirs):
    pairs = list(zip(ours.named_parameters(), theirs.named_parameters()))
    return ([n for (n, a), (_, b) in pairs if not torch.equal(a, b)],
            [n for (n, a), (_, b) in pairs if not torch.equal(a.grad, b.grad)])


def _hook(rank, views):
    """DDP + the scheduled hook (switching between DDP's path and the schedule) against DDP's
    built-in path: set_to_none alternating, every third step accumulated under no_sync."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    torch.manual_seed(0)
    ours = DDP(_Net())
    torch.manual_seed(0)
    theirs = DDP(_Net())
    state = bsp.ScheduledHookState(partition_bytes="64KiB", grad_views=views)
    ours.register_comm_hook(state, bsp.scheduled_allreduce_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    data = torch.Generator().manual_seed(rank)
    shared, plain = [], []
    for step in range(STEPS):
        batches = [(torch.randn(8, 48, generator=data), torch.randint(0, 10, (8,), generator=data))
                   for _ in range(2 if step % 3 == 2 else 1)]
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            for i, (x, y) in enumerate(batches):
                if i < len(batches) - 1:
                    with model.no_sync():
                        F.cross_entropy(model(x), y).backward()
                else:
                    F.cross_entropy(model(x), y).backward()
            optimizer.step()
        shared.append(_shares_storage(ours.module))
        plain.append(state.plain)
    out = dict(same=_same(ours.module, theirs.module), shared=shared, plain=plain)
    state.close()
    return out


def _optimizer(rank, views):
    """ScheduledOptimizer switching between its plain path and the schedule against DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    torch.manual_seed(0)
    ours = _Net()
    optimizer = bsp.ScheduledOptimizer(ours, torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9),
                                       grad_views=views)
    torch.manual_seed(0)
    theirs = DDP(_Net())
    baseline = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    shared, plain = [], []
    for step in range(STEPS):
        x, y = torch.randn(8, 48, generator=data), torch.randint(0, 10, (8,), generator=data)
        plain.append(optimizer._bytescheduler.plain)  # the path of this step (a switch comes at its end)
        for model, opt in ((ours, optimizer), (theirs, baseline)):
            opt.zero_grad(set_to_none=step % 2 == 0)
            F.cross_entropy(model(x), y).backward()
            if opt is optimizer:  # the plain path has averaged by now (DDP's end of backward)
                shared.append(_shares_storage(ours))
            opt.step()
        optimizer.synchronize()
    out = dict(same=_same(ours, theirs.module), shared=shared, plain=plain)
    optimizer.close()
    return out


def _cases(rank, world_size):
    from bytescheduler.core import modes

    modes.CHOOSER_OPTIONS.update(SHORT)
    return {(name, views): run(rank, views) for name, run in (("hook", _hook), ("optimizer", _optimizer))
            for views in (True, False)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, 2, deadline=240)


@pytest.mark.parametrize("adapter", ["hook", "optimizer"])
def test_views_keep_ddps_own_numbers_bit_for_bit(results, adapter):
    for out in results:
        for views in (True, False):
            run = out[(adapter, views)]
            assert run["same"] == ([], []), (adapter, views, run["same"])
            assert any(run["plain"]) and not all(run["plain"]), run["plain"]  # both paths ran


def test_the_hook_hands_over_views_on_both_paths(results):
    for out in results:
        assert all(out[("hook", True)]["shared"]), out[("hook", True)]
        assert not any(out[("hook", False)]["shared"]), out[("hook", False)]


def test_the_optimizers_plain_path_hands_over_views_and_the_schedule_leaves_gradients_alone(results):
    for out in results:
        run = out[("optimizer", True)]
        assert run["shared"] == run["plain"], run  # views exactly on the plain path's steps
        assert not any(out[("optimizer", False)]["shared"])


def test_bucket_views_divide_into_a_buffer_of_their_own_and_follow_a_rebuilt_bucket():
    class Bucket:  # what the hook reads of torch's GradBucket
        def __init__(self, params, buffer):
            self._params, self._buffer = params, buffer

        def index(self):
            return 0

        def buffer(self):
            return self._buffer

        def parameters(self):
            return self._params

        def gradients(self):
            sizes = [p.numel() for p in self._params]
            return [piece.view(p.shape) for piece, p in zip(torch.split(self._buffer, sizes), self._params)]

    params = [nn.Parameter(torch.zeros(128)), nn.Parameter(torch.zeros(128, 128))]  # 512 B, 64 KiB
    assert 128 * 128 * 4 >= MIN_VIEW_BYTES > 128 * 4
    views = BucketViews()
    seen = []
    for _ in range(2):  # DDP's first bucket, then the rebuilt one
        buffer = torch.arange(128 * 128 + 128, dtype=torch.float32)
        for p in params:
            p.grad = torch.zeros_like(p)
        averaged = views.divide(Bucket(params, buffer), 2)
        assert averaged.data_ptr() != buffer.data_ptr() and torch.equal(averaged, torch.arange(128 * 128 + 128) / 2)
        assert params[1].grad.data_ptr() == averaged.data_ptr() + 128 * 4  # its place in our buffer
        assert torch.equal(params[0].grad, torch.zeros(128))  # small: left to DDP's copy back
        seen.append(averaged.data_ptr())
        again = views.divide(Bucket(params, buffer), 2)  # the next iteration: the same buffer, reused
        assert again.data_ptr() == averaged.data_ptr()
    assert len(views._buckets) == 1 and views._buckets[0][0] is buffer
    # DDP with gradient_as_bucket_view=True: the gradients are its bucket already; divide in place.
    params[1].grad = buffer[128:].view(128, 128)
    assert views.divide(Bucket(params, buffer), 2).data_ptr() == buffer.data_ptr()
    # No large gradient in a bucket: divided in place, nothing handed over.
    small = torch.ones(128)
    assert views.divide(type("B", (Bucket,), {"index": lambda self: 1})([params[0]], small), 2) is small
