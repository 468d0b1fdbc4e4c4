"""Averaged gradients handed over as views of the buffer they were averaged in (``grad_views``).

The DDP hook makes each large gradient a view of its DDP bucket, so DDP's copy back is a
no-op; ScheduledOptimizer's plain path does the same with its own flat buffers instead of
copying back. Either way the numbers must be DDP's own (its built-in path, no hook), bit for
bit on 2 ranks, whether the user sets gradients to None between steps or zeroes them in
place (then backward accumulates straight into the views), with accumulation under
``no_sync``, across DDP's bucket rebuild after the first iteration, and with parameters
unused on one rank or on all (``find_unused_parameters=True``, with and without DDP's
``gradient_as_bucket_view``; against torch's ``allreduce_hook`` too).
"""

from __future__ import annotations

import os
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bytescheduler.pytorch.grad_views import MIN_VIEW_BYTES, BucketViews, can_view, hand_over
from tests.distributed import run_ranks

STEPS = 24
SHORT = dict(warmup=2, settle=1, trial=2, pairs=2, hold=3, trial_seconds=0, clear_hold=1, min_retrial=2, predict=False)


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

    os.environ["BYTESCHEDULER_MODE_SWITCH"] = modes.ModeSwitchParams(**SHORT).text()
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


class _Bucket:
    """What the hook reads of torch's GradBucket."""

    def __init__(self, params, buffer, index=0):
        self._params, self._buffer, self._index = params, buffer, index

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        sizes = [p.numel() for p in self._params]
        return [piece.view(p.shape) for piece, p in zip(torch.split(self._buffer, sizes), self._params)]


def test_bucket_views_divide_into_a_buffer_of_their_own_and_follow_a_rebuilt_bucket():
    params = [nn.Parameter(torch.zeros(128)), nn.Parameter(torch.zeros(128, 128))]  # 512 B, 64 KiB
    assert 128 * 128 * 4 >= MIN_VIEW_BYTES > 128 * 4
    views = BucketViews()
    seen = []
    for _ in range(2):  # DDP's first bucket, then the rebuilt one
        buffer = torch.arange(128 * 128 + 128, dtype=torch.float32)
        for p in params:
            p.grad = torch.zeros_like(p)
        averaged = views.divide(_Bucket(params, buffer), 2)
        assert averaged.data_ptr() != buffer.data_ptr() and torch.equal(averaged, torch.arange(128 * 128 + 128) / 2)
        assert params[1].grad.data_ptr() == averaged.data_ptr() + 128 * 4  # its place in our buffer
        assert torch.equal(params[0].grad, torch.zeros(128))  # small: left to DDP's copy back
        seen.append(averaged.data_ptr())
        again = views.divide(_Bucket(params, buffer), 2)  # the next iteration: the same buffer, reused
        assert again.data_ptr() == averaged.data_ptr()
    assert len(views._buckets) == 1 and views._buckets[0][0] is buffer
    # DDP with gradient_as_bucket_view=True: the gradients are its bucket already; divide in place.
    params[1].grad = buffer[128:].view(128, 128)
    assert views.divide(_Bucket(params, buffer), 2).data_ptr() == buffer.data_ptr()
    # No large gradient in a bucket: divided in place, nothing handed over.
    small = torch.ones(128)
    assert views.divide(_Bucket([params[0]], small, index=1), 2) is small


# --------------------------------------------------------------------------- unused parameters

class _Branches(nn.Module):
    """Large layers (256 KiB weights), of which ``local`` and ``spare`` can be left out of a forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 256)
        self.local = nn.Linear(256, 256)
        self.spare = nn.Linear(256, 256)
        self.mid = nn.Linear(256, 256)
        self.out = nn.Linear(256, 4)

    def forward(self, x, skip=()):
        h = torch.tanh(self.inp(x))
        for name in ("local", "spare"):
            if name not in skip:
                h = h + torch.tanh(getattr(self, name)(h))
        return self.out(torch.tanh(self.mid(h)))


# Which layers each rank leaves out: (rank) -> names.
UNUSED_CASES = {
    "all-used": lambda rank: (),
    "unused-on-one-rank": lambda rank: ("local",) if rank == 1 else (),
    "unused-on-all": lambda rank: ("spare",),
    "both": lambda rank: ("local", "spare") if rank == 1 else ("spare",),
}
# The hook's settings compared (the scheduled path throughout). On 3 ranks only whole,
# unmerged buckets give gloo the tensors torch's allreduce_hook gives it (the same sums).
UNUSED_HOOK_CONFIGS = {
    "defaults": dict(adaptive=False),
    "pieces": dict(partition_bytes="16KiB", credit_bytes="64KiB", merge=True, adaptive=False),
    "no-views": dict(adaptive=False, grad_views=False),
    "whole-buckets": dict(partition_bytes="1GiB", merge=False, fast_lane_bytes=0, adaptive=False),
}
UNUSED_STEPS = 4


def _train_unused(model, rank, skip):
    """Train ``model`` (DDP) a few steps; per step its loss and gradients, then its parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    losses, grads = [], []
    for step in range(UNUSED_STEPS):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        x = torch.randn(8, 16, generator=data)
        loss = model(x, skip=skip).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in model.module.parameters()])
        optimizer.step()
    return losses, grads, [p.detach().clone() for p in model.module.parameters()]


def _differences(ours, theirs):
    """What differs between two runs of :func:`_train_unused`, bit for bit (None-ness included)."""
    names = [n for n, _ in _Branches().named_parameters()]
    found = [f"loss at step {s}" for s, (a, b) in enumerate(zip(ours[0], theirs[0])) if a != b]
    for step, (mine, reference) in enumerate(zip(ours[1], theirs[1])):
        for name, a, b in zip(names, mine, reference):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                found.append(f"{name}.grad at step {step} ({'None' if a is None else 'a tensor'} against "
                             f"{'None' if b is None else 'a tensor'})")
    found += [f"{name} after training" for name, a, b in zip(names, ours[2], theirs[2]) if not torch.equal(a, b)]
    return found


def _unused_runs(rank, world_size, cases, configs):
    """DDP(find_unused_parameters=True), gradient_as_bucket_view on and off, one bucket or
    several: the scheduled hook against torch's allreduce_hook and against DDP without a hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    out = {}
    for case in cases:
        skip = UNUSED_CASES[case](rank)
        for as_view in (True, False):
            for cap in (25, 0.3):  # one bucket; about one large layer per bucket
                def ddp():
                    torch.manual_seed(0)
                    return DDP(_Branches(), find_unused_parameters=True, gradient_as_bucket_view=as_view,
                               bucket_cap_mb=cap)

                plain = _train_unused(ddp(), rank, skip)
                model = ddp()
                model.register_comm_hook(None, allreduce_hook)
                reference = _train_unused(model, rank, skip)
                result = {"no-hook": _differences(reference, plain) if world_size == 2 else None}
                for name in configs:
                    model = ddp()
                    with bsp.ScheduledHookState(timeout=10, **UNUSED_HOOK_CONFIGS[name]) as state:
                        model.register_comm_hook(state, bsp.scheduled_allreduce_hook)
                        ours = _train_unused(model, rank, skip)
                        operations = state.scheduler.stats["operations"]
                    result[name] = {"vs-allreduce-hook": _differences(ours, reference), "operations": operations,
                                    "none": [i for i, g in enumerate(ours[1][-1]) if g is None]}
                out[(case, as_view, cap)] = result
    return out


def _check_unused(results, configs, world_size):
    none_expected = {"all-used": [], "unused-on-one-rank": [], "unused-on-all": [4, 5], "both": [4, 5]}
    for rank, out in enumerate(results):
        for (case, as_view, cap), result in out.items():
            where = f"rank {rank} of {world_size}, {case}, gradient_as_bucket_view={as_view}, bucket_cap_mb={cap}"
            if world_size == 2:  # DDP's built-in path multiplies by 1/N, a hook divides: alike for N=2
                assert result["no-hook"] == [], (where, "allreduce_hook against DDP without a hook",
                                                 result["no-hook"])
            for name in configs:
                assert result[name]["operations"] > 0, (where, name)
                assert result[name]["vs-allreduce-hook"] == [], (where, name, result[name]["vs-allreduce-hook"])
                # A parameter no rank used keeps no gradient; one used elsewhere gets the average.
                assert result[name]["none"] == none_expected[case], (where, name, result[name]["none"])


def test_unused_parameters_with_and_without_bucket_views_match_torchs_hook_and_ddp_on_2_ranks():
    """The hook once took DDP's gradient_as_bucket_view=True for False when the bucket's first
    large parameter had no gradient on this rank (unused here), handed the others' gradients
    over to its own buffer, and DDP raised "not the expected DDP bucket view" at the next
    backward, while the other rank waited for the timeout."""
    configs = ("defaults", "pieces", "no-views")
    results = run_ranks(_unused_runs, 2, args=(list(UNUSED_CASES), configs), deadline=240)
    _check_unused(results, configs, 2)


def test_a_parameter_unused_on_one_rank_of_3_matches_torchs_hook():
    configs = ("whole-buckets",)
    results = run_ranks(_unused_runs, 3, args=(["unused-on-one-rank", "both"], configs), deadline=240)
    _check_unused(results, configs, 3)


def test_ddps_own_views_are_told_from_any_large_gradient_of_the_bucket():
    """gradient_as_bucket_view=True with the bucket's first large parameter unused on this rank
    (no gradient): the other large gradient is DDP's view, so the bucket is divided in place
    and no gradient is handed over (DDP raises if one is not its view any more)."""

    params = [nn.Parameter(torch.zeros(128, 128)), nn.Parameter(torch.zeros(128, 128))]
    buffer = torch.ones(2 * 128 * 128)
    bucket = _Bucket(params, buffer)
    unused, used = params
    used.grad = buffer[128 * 128:].view(128, 128)  # DDP's view of its bucket
    assert unused.grad is None
    views = BucketViews()
    assert views.divide(bucket, 2) is buffer and torch.equal(buffer, torch.full_like(buffer, 0.5))
    assert used.grad.data_ptr() == buffer.data_ptr() + 128 * 128 * 4 and unused.grad is None
