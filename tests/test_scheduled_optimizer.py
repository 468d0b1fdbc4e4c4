"""bytescheduler.pytorch.ScheduledOptimizer against DistributedDataParallel, on real gloo processes.

Every case builds, on each rank, the model twice from the same seed: one plain copy trained
through a ScheduledOptimizer and one wrapped in ``torch.nn.parallel.DistributedDataParallel``
(the baseline) trained by the same optimizer class with the same hyperparameters, both fed
the same per-rank batches. On 2 ranks the results must be bit-identical (``torch.equal``):
the gradients are computed by the same kernels, both sides divide by 2 before summing
(exact for a power of two) and a + b == b + a whatever the partitioning or merging; on
CPU the optimizers use their single-tensor code path, which updates each parameter alone,
exactly as the ScheduledOptimizer's per-parameter updates do.

Each run_ranks call spawns fresh processes (~4 s), so a worker runs several checks and
returns what it saw, and the cases that leave the processes healthy share one spawn (the
module-scoped fixtures ``real_models`` and ``small_models``); the assertions are made in
each test, on every rank's result. Cases that kill a rank or abandon communication get
processes of their own.
"""

from __future__ import annotations

import copy
import io
import os
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed import run_ranks

# Small pieces and a small credit so that every gradient of any size is partitioned and
# the small ones are merged; the scheduled path always (the mode switch has tests of its own).
SMALL = dict(partition_bytes=16 * 1024, credit_bytes=64 * 1024, adaptive=False)
STEPS = 30


# --------------------------------------------------------------------------- helpers (run on each rank)


def _seeded(make_model):
    torch.manual_seed(0)
    return make_model()


def _pair(make_model, make_optimizer, ddp_options=None, **options):
    """(ours, our optimizer, the DDP baseline, its optimizer) from the same initial weights."""
    import bytescheduler.pytorch as bsp
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours = _seeded(make_model)
    theirs = DDP(_seeded(make_model), **(ddp_options or {}))
    optimizer = bsp.ScheduledOptimizer(ours, make_optimizer(ours.parameters()), **options)
    baseline = make_optimizer(theirs.parameters())
    return ours, optimizer, theirs, baseline


def _plain(model):
    return getattr(model, "module", model)


def _param_differences(ours, theirs):
    """Names of parameters that are not bit-identical to the baseline's."""
    ours_named = list(ours.named_parameters())
    theirs_named = list(_plain(theirs).named_parameters())
    assert [n for n, _ in ours_named] == [n for n, _ in theirs_named]
    return [n for (n, a), (_, b) in zip(ours_named, theirs_named) if not torch.equal(a, b)]


def _grad_differences(ours, theirs):
    differences = []
    for (name, a), (_, b) in zip(ours.named_parameters(), _plain(theirs).named_parameters()):
        if (a.grad is None) != (b.grad is None) or (a.grad is not None and not torch.equal(a.grad, b.grad)):
            differences.append(name)
    return differences


def _state_differences(ours_state, theirs_state):
    """Where two optimizer state_dicts differ (tensors compared with torch.equal)."""
    differences = []
    if ours_state["param_groups"] != theirs_state["param_groups"]:
        differences.append(("param_groups", ours_state["param_groups"], theirs_state["param_groups"]))
    if sorted(ours_state["state"]) != sorted(theirs_state["state"]):
        differences.append(("state keys", sorted(ours_state["state"]), sorted(theirs_state["state"])))
        return differences
    for index, mine in ours_state["state"].items():
        other = theirs_state["state"][index]
        if sorted(mine) != sorted(other):
            differences.append((index, sorted(mine), sorted(other)))
            continue
        for key, value in mine.items():
            if isinstance(value, torch.Tensor):
                same = isinstance(other[key], torch.Tensor) and torch.equal(value, other[key])
            else:
                same = value == other[key]
            if not same:
                differences.append((index, key))
    return differences


def _train_step(model, optimizer, x, y, zero_grad=None):
    if zero_grad is None:
        optimizer.zero_grad()
    else:
        optimizer.zero_grad(set_to_none=zero_grad)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def _pending(optimizer):
    """How many parameters have a gradient in flight or an update not yet applied (diagnostic)."""
    return sum(1 for state in optimizer._bytescheduler.states.values() if state.stage != 0)


def _our_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("bytescheduler"))


def _images(generator, batch=8, size=8):
    x = torch.randn(batch, 3, size, size, generator=generator)
    return x, torch.randint(0, 10, (batch,), generator=generator)


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(),
                         nn.Linear(32, 10))


class _OutsideUse(nn.Module):
    """Parameters read outside their own module's forward.

    ``proj``'s forward never runs: its weight is used by the parent's ``F.linear`` (its
    bias is never used at all), and ``scale`` is a parameter of the parent used directly.
    """

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3 * 8 * 8, 64)
        self.proj = nn.Linear(64, 64)
        self.scale = nn.Parameter(torch.ones(64))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        h = torch.tanh(self.inp(x.flatten(1)))
        h = torch.tanh(F.linear(h, self.proj.weight) * self.scale)
        return self.head(h)


class _Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(3 * 8 * 8, 64)
        self.frozen = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.frozen(torch.tanh(self.stem(x.flatten(1))))))


class _UndeclaredSparse(nn.Module):
    """A sparse gradient that no module declares: F.embedding(..., sparse=True) on a bare
    parameter (nn.Embedding(sparse=True) is supported: tests/test_sparse_gradients.py)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(100, 16))
        self.head = nn.Linear(16, 10)

    def forward(self, tokens):
        return self.head(F.embedding(tokens, self.table, sparse=True).mean(1))


# --------------------------------------------------------------------------- grouped runs


def _run_cases(rank, world_size, names):
    """Run several cases on one pair of processes (a spawn costs seconds); one result each.

    A case that raises reports its traceback (a string starting with "EXCEPTION") and the
    next case still runs.
    """
    import traceback

    results = {}
    for name in names:
        function, args = CASES[name]
        try:
            results[name] = function(rank, world_size, *args)
        except Exception:  # noqa: BLE001 - reported by the case's own test
            results[name] = "EXCEPTION\n" + traceback.format_exc()
    return results


def _results(grouped, name):
    """The result of case ``name`` on every rank; fails with the traceback if it raised."""
    outs = [per_rank[name] for per_rank in grouped]
    for rank, out in enumerate(outs):
        if isinstance(out, str) and out.startswith("EXCEPTION"):
            pytest.fail(f"case {name} raised on rank {rank}:\n{out}")
    return outs


REAL_CASES = ("real:cnn-small", "real:gpt2-small", "evaluation")
SMALL_CASES = ("prompt_free", "auto_tune", "any_optimizer", "drop_in", "outside_use", "frozen", "clipping",
               "clipping_held", "zero_grad", "misuse")


@pytest.fixture(scope="module")
def real_models():
    return run_ranks(_run_cases, 2, (REAL_CASES,), deadline=300)


@pytest.fixture(scope="module")
def small_models():
    return run_ranks(_run_cases, 2, (SMALL_CASES,), deadline=300)


# --------------------------------------------------------------------------- 1. same numbers on real models


def _real_models(rank, world_size, name):
    from bytescheduler_tools.bench.models import build

    results = {}
    for kind in ("sgd", "adamw"):
        if kind == "sgd":
            cls, make = torch.optim.SGD, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4)
        else:
            cls, make = torch.optim.AdamW, lambda ps: torch.optim.AdamW(ps, lr=2e-3, weight_decay=0.05)
        ours, optimizer, theirs, baseline = _pair(lambda: build(name)[0], make, **SMALL)
        make_batch = build(name)[1]
        schedulers = []
        if kind == "adamw":
            schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5) for o in (optimizer, baseline)]
        data = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            x, y = make_batch(4, data)
            for i, (model, opt) in enumerate(((ours, optimizer), (theirs, baseline))):
                _train_step(model, opt, x, y)
                if schedulers:
                    schedulers[i].step()  # right after step(): this step's updates are still pending
        optimizer.synchronize()
        stats = optimizer._bytescheduler.scheduler.stats
        results[kind] = dict(
            is_instance=isinstance(optimizer, cls),
            params=_param_differences(ours, theirs),
            grads=_grad_differences(ours, theirs),
            lr=(optimizer.param_groups[0]["lr"], baseline.param_groups[0]["lr"]),
            tensors=len(list(ours.parameters())),
            stats=stats,
        )
        optimizer.close()
    return results


@pytest.mark.parametrize("name", ["cnn-small", "gpt2-small"])
def test_same_numbers_as_ddp_after_30_steps(real_models, name):
    for result in _results(real_models, f"real:{name}"):
        for kind, r in result.items():
            assert r["is_instance"], kind
            assert r["params"] == [], (kind, r["params"])
            assert r["grads"] == [], (kind, r["grads"])
            assert r["lr"][0] == r["lr"][1], (kind, r["lr"])
            # Some gradients were partitioned (more pieces than tensors) and merged (fewer
            # operations than pieces).
            assert r["stats"]["pieces"] > STEPS * r["tensors"], (kind, r["stats"])
            assert r["stats"]["operations"] < r["stats"]["pieces"], (kind, r["stats"])
        assert result["adamw"]["lr"][0] == pytest.approx(2e-3 * 0.5 ** (STEPS // 7))


# --------------------------------------------------------------------------- 2. any optimizer


OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01),
}


def _any_optimizer(rank, world_size):
    results = {}
    for name, make in OPTIMIZERS.items():
        ours, optimizer, theirs, baseline = _pair(_mlp, make, **SMALL)
        data = torch.Generator().manual_seed(rank)
        with optimizer:
            for _ in range(5):
                x, y = _images(data)
                _train_step(ours, optimizer, x, y)
                _train_step(theirs, baseline, x, y)
            optimizer.synchronize()
            results[name] = (type(optimizer).__name__, isinstance(optimizer, type(baseline)),
                             _param_differences(ours, theirs),
                             _state_differences(optimizer.state_dict(), baseline.state_dict()))
    return results


def test_any_optimizer_equals_ddp(small_models):
    for result in _results(small_models, "any_optimizer"):
        assert sorted(result) == sorted(OPTIMIZERS)
        for name, (class_name, is_instance, params, state) in result.items():
            assert class_name == name and is_instance, name
            assert params == [], (name, params)
            assert state == [], (name, state)


def test_gradients_are_freed_without_waiting_for_the_garbage_collector(small_models):
    for leaked in _results(small_models, "prompt_free"):
        assert leaked == [0, 0, 0], f"gradients still alive after zero_grad, per step: {leaked}"


def test_auto_tuning_on_rank_0_changes_sizes_and_keeps_the_numbers(small_models):
    leader, follower = _results(small_models, "auto_tune")
    assert leader["params"] == [] and follower["params"] == []
    assert follower["tuner"] is None, "followers replay rank 0's pieces: they must not tune"
    done, settings, result = leader["tuner"]
    assert done, f"tuning did not finish in 150 steps: {settings}"
    assert len(set(settings)) >= 4 and len({p for p, _ in settings}) >= 2, settings
    assert leader["in_use"] == result


# --------------------------------------------------------------------------- 3. drop-in behaviour


def _drop_in(rank, world_size):
    import bytescheduler.pytorch as bsp

    lr = 1e-2
    user_optimizer = None

    def make(ps):
        nonlocal user_optimizer
        made = torch.optim.Adam(ps, lr=lr, weight_decay=1e-3)
        if user_optimizer is None:  # the first one is ours (the second the baseline's)
            user_optimizer = made
        return made

    ours, optimizer, theirs, baseline = _pair(_mlp, make, **SMALL)
    out = {}
    out["same_param_groups"] = optimizer.param_groups is user_optimizer.param_groups
    out["same_state"] = optimizer.state is user_optimizer.state
    data = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x, y = _images(data)
        _train_step(ours, optimizer, x, y)
        _train_step(theirs, baseline, x, y)
    # state_dict() synchronizes by itself.
    saved = optimizer.state_dict()
    out["state_dict"] = _state_differences(saved, baseline.state_dict())
    out["params_after_5"] = _param_differences(ours, theirs)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    optimizer.close()

    # A fresh ScheduledOptimizer (different lr on purpose) restored from the checkpoint.
    fresh = bsp.ScheduledOptimizer(ours, torch.optim.Adam(ours.parameters(), lr=0.5), **SMALL)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    out["lr_loaded"] = fresh.param_groups[0]["lr"]
    for _ in range(5):
        x, y = _images(data)
        _train_step(ours, fresh, x, y)
        _train_step(theirs, baseline, x, y)
    fresh.synchronize()
    out["params_after_reload"] = _param_differences(ours, theirs)
    out["state_after_reload"] = _state_differences(fresh.state_dict(), baseline.state_dict())

    # Hyperparameters in force at step() apply to that step's updates: the lr is changed
    # right after step(), while that step's updates are still pending, and before the next
    # forward; the baseline changes it after its (synchronous) step.
    pending = []
    for step in range(6):
        new_lr = 0.0 if step % 2 == 0 else lr
        x, y = _images(data)
        _train_step(ours, fresh, x, y)
        pending.append(_pending(fresh))
        for group in fresh.param_groups:
            group["lr"] = new_lr
        _train_step(theirs, baseline, x, y)
        for group in baseline.param_groups:
            group["lr"] = new_lr
    fresh.synchronize()
    out["params_after_lr_changes"] = _param_differences(ours, theirs)
    out["pending_at_lr_change"] = pending
    fresh.close()
    return out


def test_drop_in_state_dict_load_state_dict_and_hyperparameters_at_step(small_models):
    for out in _results(small_models, "drop_in"):
        assert out["same_param_groups"] and out["same_state"]
        assert out["state_dict"] == []
        assert out["params_after_5"] == []
        assert out["lr_loaded"] == 1e-2
        assert out["params_after_reload"] == []
        assert out["state_after_reload"] == []
        assert out["params_after_lr_changes"] == []
        # The check above means something only if some update was still pending when
        # the lr changed (it is: the last gradients of backward are still in flight).
        assert max(out["pending_at_lr_change"]) > 0, out["pending_at_lr_change"]


# --------------------------------------------------------------------------- 4. gradient accumulation


def _accumulation(rank, world_size):
    import bytescheduler.pytorch as bsp

    k = 3
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    ours, optimizer, theirs, baseline = _pair(_mlp, make, backward_passes_per_step=k, **SMALL)
    data = torch.Generator().manual_seed(rank)
    out = {"per_step": []}
    # The last step accumulates only 2 passes: a step after fewer passes communicates what
    # was accumulated (the baseline all-reduces at its 2nd pass).
    for passes in (k, k, k, k, 2):
        optimizer.zero_grad()
        baseline.zero_grad()
        for i in range(passes):
            x, y = _images(data)
            (F.cross_entropy(ours(x), y) / k).backward()
            if i < passes - 1:
                with theirs.no_sync():
                    (F.cross_entropy(theirs(x), y) / k).backward()
            else:
                (F.cross_entropy(theirs(x), y) / k).backward()
        optimizer.step()
        baseline.step()
        optimizer.synchronize()
        out["per_step"].append((_param_differences(ours, theirs), _grad_differences(ours, theirs)))
    optimizer.close()

    # Without backward_passes_per_step, a second backward before step() is an error. Rank 1
    # is late to its first backward (ranks are never in lockstep), so rank 0's first
    # gradients are certainly still being communicated when its second backward arrives.
    plain = bsp.ScheduledOptimizer(ours, torch.optim.SGD(ours.parameters(), lr=0.05), **SMALL)
    plain_baseline = torch.optim.SGD(theirs.parameters(), lr=0.05)
    x, y = _images(data)
    plain.zero_grad()
    if rank == 1:
        time.sleep(1.0)
    F.cross_entropy(ours(x), y).backward()
    try:
        F.cross_entropy(ours(x), y).backward()
        out["second_backward"] = ("no error", "", False)
    except Exception as error:  # noqa: BLE001
        out["second_backward"] = (type(error).__name__, str(error), isinstance(error, bsp.GradientError))
    # The error refused the second gradient: after zero_grad() the loop goes on and trains
    # like DDP (the first pass's gradient must not have been changed while in flight).
    try:
        _train_step(ours, plain, x, y)
        _train_step(theirs, plain_baseline, x, y)
        plain.synchronize()
        out["after_error"] = _param_differences(ours, theirs)
    except Exception as error:  # noqa: BLE001
        out["after_error"] = f"{type(error).__name__}: {error}"
    plain.close(wait=False)
    out["threads"] = _our_threads()
    return out


def test_gradient_accumulation_equals_ddp_no_sync_and_second_backward_is_an_error():
    for out in run_ranks(_accumulation, 2, deadline=120):
        for step, (params, grads) in enumerate(out["per_step"]):
            assert params == [] and grads == [], (step, params, grads)
        name, message, is_gradient_error = out["second_backward"]
        assert is_gradient_error, (name, message)
        assert "backward_passes_per_step" in message, message
        assert out["after_error"] == [], out["after_error"]
        assert out["threads"] == []


# --------------------------------------------------------------------------- 5. parameters used outside their module


def _outside_use(rank, world_size):
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    # proj.bias is never used: DDP needs find_unused_parameters.
    ours, optimizer, theirs, baseline = _pair(_OutsideUse, make, dict(find_unused_parameters=True), **SMALL)
    initial_bias = ours.proj.bias.detach().clone()
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = _images(data)
        _train_step(ours, optimizer, x, y)
        _train_step(theirs, baseline, x, y)
    optimizer.synchronize()
    out = dict(params=_param_differences(ours, theirs),
               unused_bias_unchanged=torch.equal(ours.proj.bias, initial_bias),
               scale_trained=not torch.equal(ours.scale, torch.ones(64)))
    optimizer.close()
    return out


def test_parameters_used_outside_their_module_forward(small_models):
    for out in _results(small_models, "outside_use"):
        assert out["params"] == [], out["params"]
        assert out["unused_bias_unchanged"] and out["scale_trained"]


# --------------------------------------------------------------------------- 6. frozen parameters


def _frozen(rank, world_size):
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2)  # noqa: E731
    ours, optimizer, theirs, baseline = _pair(_Frozen, make, **SMALL)
    initial = [p.detach().clone() for p in ours.frozen.parameters()]
    data = torch.Generator().manual_seed(rank)
    for _ in range(10):
        x, y = _images(data)
        _train_step(ours, optimizer, x, y)
        _train_step(theirs, baseline, x, y)
    optimizer.synchronize()
    out = dict(params=_param_differences(ours, theirs),
               frozen_unchanged=all(torch.equal(a, b) for a, b in zip(ours.frozen.parameters(), initial)),
               frozen_grads=[p.grad is None for p in ours.frozen.parameters()])
    optimizer.close()
    return out


def test_frozen_parameters_stay_and_the_rest_equals_ddp(small_models):
    for out in _results(small_models, "frozen"):
        assert out["params"] == []
        assert out["frozen_unchanged"]
        assert out["frozen_grads"] == [True, True]


# --------------------------------------------------------------------------- 7. evaluation between steps


def _evaluation(rank, world_size):
    from bytescheduler_tools.bench.models import build

    out = {}
    for name in ("cnn-small", "gpt2-small"):
        make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
        ours, optimizer, theirs, baseline = _pair(lambda: build(name)[0], make, **SMALL)
        make_batch = build(name)[1]
        data = torch.Generator().manual_seed(rank)
        held_out, _ = make_batch(4, torch.Generator().manual_seed(1234))
        mismatches = []
        for step in range(10):
            x, y = make_batch(4, data)
            _train_step(ours, optimizer, x, y)
            _train_step(theirs, baseline, x, y)
            outputs = []
            for model in (ours, theirs):  # ours right after step(): its updates are pending
                model.eval()
                with torch.no_grad():
                    outputs.append(model(held_out))
                model.train()
            if not torch.equal(*outputs):
                mismatches.append(step)
        optimizer.synchronize()
        out[name] = (mismatches, _param_differences(ours, theirs))
        optimizer.close()
    return out


def test_evaluation_between_steps_sees_current_weights(real_models):
    for out in _results(real_models, "evaluation"):
        for name, (mismatches, params) in out.items():
            assert mismatches == [], (name, mismatches)
            assert params == [], (name, params)


# --------------------------------------------------------------------------- 8. gradient clipping


def _clipping(rank, world_size):
    from bytescheduler_tools.bench.models import build

    max_norm = 0.5
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    ours, optimizer, theirs, baseline = _pair(lambda: build("cnn-small")[0], make, **SMALL)
    make_batch = build("cnn-small")[1]
    data = torch.Generator().manual_seed(rank)
    norms = []
    for _ in range(10):
        x, y = make_batch(4, data)
        pair = []
        for model, opt in ((ours, optimizer), (theirs, baseline)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pair.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
            opt.step()
        norms.append(tuple(pair))
    optimizer.synchronize()
    out = dict(params=_param_differences(ours, theirs), grads=_grad_differences(ours, theirs), norms=norms)
    optimizer.close()
    return out


def test_gradient_clipping_by_global_norm_equals_ddp(small_models):
    for out in _results(small_models, "clipping"):
        assert all(a == b for a, b in out["norms"]), out["norms"]
        assert any(a > 0.5 for a, _ in out["norms"]), out["norms"]  # clipping did clip
        assert out["params"] == [] and out["grads"] == []


def _clipping_while_held(rank, world_size):
    # A minute-long merge cycle and the default partition: rank 0 would hold every gradient of
    # this small model until step(), but clipping reads them before step(), every other time
    # after synchronize().
    from bytescheduler_tools.bench.models import build

    make = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    ours, optimizer, theirs, baseline = _pair(lambda: build("cnn-small")[0], make, cycle_ms=60_000, timeout=30)
    make_batch = build("cnn-small")[1]
    data = torch.Generator().manual_seed(rank)
    clip_seconds = []
    for iteration in range(4):
        x, y = make_batch(4, data)
        for model, opt in ((ours, optimizer), (theirs, baseline)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            start = time.monotonic()
            if model is ours and iteration % 2:
                optimizer.synchronize()  # as Horovod users do before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if model is ours:
                clip_seconds.append(time.monotonic() - start)
            opt.step()
    optimizer.synchronize()
    out = dict(params=_param_differences(ours, theirs), clip_seconds=clip_seconds)
    optimizer.close()
    return out


def test_reading_gradients_before_step_ends_the_merge_cycle(small_models):
    for out in _results(small_models, "clipping_held"):
        assert max(out["clip_seconds"]) < 5.0, out["clip_seconds"]
        assert out["params"] == []


# --------------------------------------------------------------------------- 9. zero_grad variants


def _zero_grad(rank, world_size):
    out = {}
    for set_to_none in (True, False):
        make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731
        ours, optimizer, theirs, baseline = _pair(_mlp, make, **SMALL)
        data = torch.Generator().manual_seed(rank)
        for _ in range(10):
            x, y = _images(data)
            _train_step(ours, optimizer, x, y, zero_grad=set_to_none)
            _train_step(theirs, baseline, x, y, zero_grad=set_to_none)
        optimizer.synchronize()
        params, grads = _param_differences(ours, theirs), _grad_differences(ours, theirs)
        # zero_grad right after step() (updates pending) then read the grads.
        x, y = _images(data)
        _train_step(ours, optimizer, x, y)
        _train_step(theirs, baseline, x, y)
        optimizer.zero_grad(set_to_none=set_to_none)
        baseline.zero_grad(set_to_none=set_to_none)
        after = [None if p.grad is None else bool(p.grad.eq(0).all()) for p in ours.parameters()]
        optimizer.synchronize()
        out[set_to_none] = dict(params=params, grads=grads, after_zero=after,
                                final_params=_param_differences(ours, theirs))
        optimizer.close()
    return out


def test_zero_grad_set_to_none_true_and_false_equal_ddp(small_models):
    for out in _results(small_models, "zero_grad"):
        for set_to_none, r in out.items():
            assert r["params"] == [] and r["grads"] == [], (set_to_none, r)
            assert r["final_params"] == [], (set_to_none, r)
            assert r["after_zero"] == ([None] * 6 if set_to_none else [True] * 6), (set_to_none, r)


# --------------------------------------------------------------------------- 10. exception in the user's loop


class _Boom(Exception):
    pass


def _exception_in_loop(rank, world_size, late_rank):
    import torch.distributed as dist
    import bytescheduler.pytorch as bsp
    from torch.nn.parallel import DistributedDataParallel as DDP

    options = dict(SMALL, timeout=20)  # a hang after the restart fails in 20 s, not 300
    model = _seeded(_mlp)
    data = torch.Generator().manual_seed(rank)
    out = {}
    optimizer = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), **options)
    try:
        with optimizer:
            for step in range(5):
                x, y = _images(data)
                optimizer.zero_grad()
                if step == 2 and rank == late_rank:
                    time.sleep(1.0)  # the ranks are out of step when the error strikes
                F.cross_entropy(model(x), y).backward()
                if step == 2:  # gradients in flight, the last step's updates maybe too
                    raise _Boom("user code failed")
                optimizer.step()
        out["raised"] = False
    except _Boom:
        out["raised"] = True
    out["threads_after_exit"] = _our_threads()

    # A new ScheduledOptimizer on the same model trains like DDP from the same weights.
    again, status = None, "ok"
    try:
        again = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), **options)
    except Exception as error:  # noqa: BLE001
        status = f"rank {rank}: {type(error).__name__}: {error}"
    statuses = [None] * world_size
    dist.all_gather_object(statuses, status)  # a rank alone cannot go on: agree first
    if any(s != "ok" for s in statuses):
        out["restart"] = [s for s in statuses if s != "ok"]
        if again is not None:
            again.close(wait=False)
        return out
    theirs = DDP(copy.deepcopy(model))
    baseline = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    out["same_start"] = _param_differences(model, theirs)
    try:
        for _ in range(5):
            x, y = _images(data)
            _train_step(model, again, x, y)
            _train_step(theirs, baseline, x, y)
        again.synchronize()
        out["restart"] = _param_differences(model, theirs)
    except Exception as error:  # noqa: BLE001
        out["restart"] = f"{type(error).__name__}: {error}"
        again.close(wait=False)
        return out
    again.close()
    out["threads_at_end"] = _our_threads()
    return out


@pytest.mark.parametrize("late_rank", [None, 0, 1], ids=["in-step", "rank0-late", "rank1-late"])
def test_exception_in_loop_shuts_down_cleanly_and_a_new_optimizer_trains(late_rank):
    # expect_failures: a rank that crashes (e.g. aborted by gloo) is reported with the other's result.
    results = run_ranks(_exception_in_loop, 2, (late_rank,), deadline=120, expect_failures=True)
    assert not any(isinstance(out, str) for out in results), results
    for out in results:
        assert out["raised"]
        assert out["threads_after_exit"] == [], out["threads_after_exit"]
        assert out["restart"] == [], out["restart"]
        assert out["same_start"] == []
        assert out["threads_at_end"] == []


# --------------------------------------------------------------------------- 11. a rank dies


def _peer_dies(rank, world_size, how, timeout):
    import bytescheduler.pytorch as bsp

    model = _seeded(_mlp)
    optimizer = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), timeout=timeout, **SMALL)
    data = torch.Generator().manual_seed(rank)
    started = None
    for step in range(8):
        if step == 3:
            if rank == 1:
                if how == "hang":  # alive but silent: only the timeout can tell
                    time.sleep(timeout + 6)
                os._exit(17)  # a peer dies in the middle of training
            started = time.monotonic()
        try:
            x, y = _images(data)
            _train_step(model, optimizer, x, y)
            if step == 7:
                optimizer.synchronize()
        except Exception as error:  # noqa: BLE001
            elapsed = time.monotonic() - (started if started is not None else 0.0)
            closing = time.monotonic()
            optimizer.close(wait=False)  # in the except block, as a user's would be
            return type(error).__name__, str(error), elapsed, step, time.monotonic() - closing
    optimizer.close(wait=False)
    return "no error", "", 0.0, -1, 0.0


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_dead_peer_raises_within_timeout(how):
    timeout = 6.0
    results = run_ranks(_peer_dies, 2, (how, timeout), deadline=120, expect_failures=True)
    assert results[1].startswith("ERROR") and "code 17" in results[1], results[1]
    name, message, elapsed, step, closing = results[0]
    # gloo fails the operations on the dead peer at once; nothing of ours keeps their tensors
    # (a failure's traceback did, and close() waited 10 s for them: docs/reliability.md).
    assert closing < 2, results[0]
    assert step >= 3, results[0]
    assert elapsed < timeout + 5, results[0]
    assert name in ("CommunicationError", "CommunicationTimeout"), results[0]
    assert "peer" in message, message


# --------------------------------------------------------------------------- 12. misuse


def _misuse(rank, world_size):
    import bytescheduler.pytorch as bsp
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}

    def attempt(key, action):
        try:
            action()
            out[key] = ("no error", "")
        except Exception as error:  # noqa: BLE001
            out[key] = (type(error).__name__, str(error))

    wrapped = DDP(_seeded(_mlp))
    attempt("ddp", lambda: bsp.ScheduledOptimizer(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1)))

    model = _seeded(_mlp)
    optimizer = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), **SMALL)
    x, y = _images(torch.Generator().manual_seed(rank))
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    attempt("closure", lambda: optimizer.step(lambda: F.cross_entropy(model(x), y)))
    optimizer.step()  # the loop goes on after the error
    attempt("wrap_twice", lambda: bsp.ScheduledOptimizer(model, optimizer))
    optimizer.close()

    sparse = _seeded(_UndeclaredSparse)
    sparse_optimizer = bsp.ScheduledOptimizer(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1), **SMALL)
    tokens = torch.randint(0, 100, (4, 5), generator=torch.Generator().manual_seed(rank))
    attempt("sparse", lambda: F.cross_entropy(sparse(tokens), y[:4]).backward())
    out["sparse_is_gradient_error"] = out["sparse"][0] == bsp.GradientError.__name__
    sparse_optimizer.zero_grad()
    sparse_optimizer.close()
    out["threads"] = _our_threads()
    return out


def test_misuse_gives_clear_errors(small_models):
    for out in _results(small_models, "misuse"):
        name, message = out["ddp"]
        assert name == "TypeError" and "DistributedDataParallel" in message, out["ddp"]
        name, message = out["closure"]
        assert name == "ValueError" and "closure" in message, out["closure"]
        name, message = out["wrap_twice"]
        assert name == "TypeError" and "already wrapped" in message, out["wrap_twice"]
        name, message = out["sparse"]
        assert out["sparse_is_gradient_error"] and "'table'" in message and "declare" in message, out["sparse"]
        assert out["threads"] == []


def _auto_tune(rank, world_size):
    """Auto-tuning switches partition and credit sizes while training; the numbers stay DDP's."""
    ours, optimizer, theirs, baseline = _pair(
        _mlp, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), auto_tune=True, **SMALL)
    scheduler = optimizer._bytescheduler.scheduler
    data = torch.Generator().manual_seed(rank)
    with optimizer:
        for _ in range(150):  # the same number of steps on every rank
            x, y = _images(data)
            _train_step(ours, optimizer, x, y)
            _train_step(theirs, baseline, x, y)
        optimizer.synchronize()
        tuner = scheduler.tuner
        return {
            "params": _param_differences(ours, theirs),
            "tuner": None if tuner is None else (tuner.done, [(t.partition_bytes, t.credit_bytes) for t in tuner.history],
                                                 tuner.result),
            "in_use": (scheduler.config.partition_bytes, scheduler.config.credit_bytes),
        }


def _prompt_free(rank, world_size):
    """Communicated gradients are freed as soon as nobody needs them, without the garbage collector.

    A gradient kept alive until a collection makes every backward allocate fresh memory
    (page faults, ~20% of the training thread's time on VGG) and frees it at random times.
    """
    import gc
    import weakref

    ours, optimizer, _, _ = _pair(_mlp, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), **SMALL)
    data = torch.Generator().manual_seed(rank)
    leaked = []
    gc.disable()
    try:
        with optimizer:
            for _ in range(3):
                x, y = _images(data)
                optimizer.zero_grad()
                F.cross_entropy(ours(x), y).backward()
                grads = [weakref.ref(p.grad) for p in ours.parameters()]
                optimizer.step()
                optimizer.synchronize()
                optimizer.zero_grad()  # set_to_none: nothing of ours holds the old gradients now
                # gloo may drop its finished work objects (which hold the tensors) a moment later;
                # a reference cycle, with the collector disabled, would never let go.
                deadline = time.monotonic() + 2.0
                while any(ref() is not None for ref in grads) and time.monotonic() < deadline:
                    time.sleep(0.01)
                leaked.append(sum(1 for ref in grads if ref() is not None))
    finally:
        gc.enable()
    return leaked


CASES = {
    "prompt_free": (_prompt_free, ()),
    "auto_tune": (_auto_tune, ()),
    "real:cnn-small": (_real_models, ("cnn-small",)),
    "real:gpt2-small": (_real_models, ("gpt2-small",)),
    "evaluation": (_evaluation, ()),
    "any_optimizer": (_any_optimizer, ()),
    "drop_in": (_drop_in, ()),
    "outside_use": (_outside_use, ()),
    "frozen": (_frozen, ()),
    "clipping": (_clipping, ()),
    "clipping_held": (_clipping_while_held, ()),
    "zero_grad": (_zero_grad, ()),
    "misuse": (_misuse, ()),
}


def _add_param_group_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    ours, base = net(), DDP(net())
    opt = bsp.ScheduledOptimizer(ours, torch.optim.SGD(ours[0].parameters(), lr=0.1, momentum=0.9))
    ref = torch.optim.SGD(base.module[0].parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for step in range(8):
        if step == 3:  # a second group, with its own learning rate, after training started
            opt.add_param_group({"params": list(ours[2].parameters()), "lr": 0.01})
            ref.add_param_group({"params": list(base.module[2].parameters()), "lr": 0.01})
        x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
        for model, optimizer in ((ours, opt), (base, ref)):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    opt.synchronize()
    groups = [state.group for state in opt._bytescheduler.states.values()]
    same = all(torch.equal(a, b) for a, b in zip(ours.parameters(), base.module.parameters()))
    opt.close()
    return same, groups


def test_add_param_group_after_training_started_equals_ddp():
    for same, groups in run_ranks(_add_param_group_worker, 2, deadline=120):
        assert same
        assert groups == [0, 0, 1, 1]


# --------------------------------------------------------------------------- 7. memory reuse


def _page_faults_per_iteration(rank, world_size):
    """Minor page faults of a steady-state iteration, and how many pages the gradients fill."""
    import bytescheduler.pytorch as bsp
    from bytescheduler_tools.bench.models import build

    def minor_faults():
        with open("/proc/self/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[7])

    torch.manual_seed(0)
    model, make_batch = build("vgg-small")
    # The scheduled path (the plain path keeps its buckets, as DDP does).
    optimizer = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                       adaptive=False)
    x, y = make_batch(8, torch.Generator().manual_seed(rank))
    for _ in range(5):
        _train_step(model, optimizer, x, y)
    optimizer.synchronize()
    before, iterations = minor_faults(), 10
    for _ in range(iterations):
        _train_step(model, optimizer, x, y)
    optimizer.synchronize()
    faults = (minor_faults() - before) / iterations
    optimizer.close()
    pages = sum(p.numel() * p.element_size() for p in model.parameters()) / os.sysconf("SC_PAGE_SIZE")
    return faults, pages


def test_backward_reuses_gradient_memory_instead_of_faulting_it_in_afresh():
    """The next forward runs while the last gradients are freed; glibc must not hand that memory back
    to the kernel each time (it did: 4,400-5,000 faults per iteration for these 5,400 pages, 0.8x of DDP).
    A process of its own: glibc's thresholds are per process and only ever rise."""
    for faults, pages in run_ranks(_page_faults_per_iteration, 2, deadline=180):
        assert faults < pages / 10, f"{faults:.0f} page faults per iteration for {pages:.0f} pages of gradients"
