"""The scheduled DDP hook gives DDP's numbers, over real gloo processes."""

import json
import os
import time

import pytest
import torch

from tests.distributed import run_ranks

STEPS = 50


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 8 * 8, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def _train_pair(rank, world_size, options, reference, lockstep=False):
    """Train our hook's model and a reference side by side; return the largest differences.

    With ``lockstep`` the reference is reset to our parameters and momentum after every
    step and the differences are those of the averaged gradients, the largest over all
    steps: where the sum order differs (3 ranks, other operation boundaries) rounding
    differences of ~1e-8 grow step by step in a chaotic training run, so only a per-step
    comparison can hold the result to a tight bound.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    ours = DDP(_model(), bucket_cap_mb=0.1)
    theirs = DDP(_model(), bucket_cap_mb=0.1)
    # The scheduled path at every step, unless a test is about the mode switch.
    state = bsp.ScheduledHookState(**dict(dict(adaptive=False), **options))
    ours.register_comm_hook(state, bsp.scheduled_allreduce_hook)
    if reference == "allreduce_hook":
        theirs.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    data = torch.Generator().manual_seed(rank)
    absolute = relative = 0.0
    for _ in range(STEPS):
        x = torch.randn(16, 3, 8, 8, generator=data)
        y = torch.randint(0, 10, (16,), generator=data)
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        if lockstep:
            pairs = [(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters())]
            absolute = max([absolute, *((a - b).abs().max().item() for a, b in pairs)])
            relative = max([relative, *(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in pairs)])
        for optimizer in optimizers:
            optimizer.step()
        if lockstep:
            with torch.no_grad():
                for a, b in zip(ours.parameters(), theirs.parameters()):
                    b.copy_(a)
                    optimizers[1].state[b]["momentum_buffer"].copy_(optimizers[0].state[a]["momentum_buffer"])
    state.close()
    if not lockstep:
        absolute = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
        relative = max(
            ((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(ours.parameters(), theirs.parameters())
        )
    tuner = state.scheduler.tuner
    stats = dict(state.scheduler.stats, trials=None if tuner is None else len(tuner.history))
    return absolute, relative, stats


@pytest.mark.parametrize("world_size", [2, 3])
def test_equals_ddp_default_within_1e6(world_size):
    # Two ranks: the whole run stays within 1e-6 (a sum of two is the same in any order).
    # Three: every step's averaged gradients do, from the same parameters (see lockstep).
    options = dict(partition_bytes=16 * 1024, credit_bytes=64 * 1024)
    for absolute, relative, stats in run_ranks(
        _train_pair, world_size, (options, "builtin", world_size > 2), deadline=180
    ):
        assert relative <= 1e-6, (absolute, relative)
        assert stats["pieces"] > STEPS  # the hook ran every step, and partitioned
        assert stats["peak_in_flight_bytes"] + stats["peak_fast_lane_bytes"] > 0


@pytest.mark.parametrize("auto_tune", [False, True])
def test_equals_allreduce_hook_exactly_on_two_ranks_with_partition_and_merge(auto_tune):
    options = dict(partition_bytes=16 * 1024, credit_bytes=64 * 1024, merge=True, auto_tune=auto_tune)
    leader, follower = run_ranks(_train_pair, 2, (options, "allreduce_hook"), deadline=180)
    assert leader[0] == 0.0 and follower[0] == 0.0
    assert follower[2]["trials"] is None  # only rank 0 decides pieces, so only it tunes
    if auto_tune:
        assert leader[2]["trials"] >= 3, "the tuner must have measured several settings during training"
    else:
        assert leader[2]["trials"] is None


def test_equals_allreduce_hook_exactly_on_three_ranks_with_merging_off():
    # With 3 ranks the sum order depends on where an all-reduce's chunks start, so
    # exactness needs the same operation boundaries as DDP's: no merge, no partition.
    options = dict(partition_bytes=1 << 30, merge=False)
    for absolute, _, _ in run_ranks(_train_pair, 3, (options, "allreduce_hook"), deadline=180):
        assert absolute == 0.0


def _peer_dies(rank, world_size, how, timeout):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    model = DDP(_model())
    state = bsp.ScheduledHookState(timeout=timeout)
    model.register_comm_hook(state, bsp.scheduled_allreduce_hook)
    x = torch.randn(4, 3, 8, 8)
    for step in range(5):
        if rank == 1 and step == 3:
            if how == "hang":  # alive but silent: only a timeout can tell
                time.sleep(3 * timeout)
            os._exit(17)  # a peer dies in the middle of training
        started = time.monotonic()
        try:
            model(x).sum().backward()
            state.scheduler.check()
        except Exception as error:  # noqa: BLE001
            elapsed = time.monotonic() - started
            state.close(wait=False)
            return type(error).__name__, str(error), elapsed, step
    return "no error", "", 0.0, -1


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_dead_peer_raises_within_timeout(how):
    timeout = 6.0
    results = run_ranks(_peer_dies, 2, (how, timeout), deadline=120, expect_failures=True)
    assert results[1].startswith("ERROR") and "code 17" in results[1]
    name, message, elapsed, step = results[0]
    assert step == 3, results[0]
    assert elapsed < timeout + 5, results[0]
    # Raised by the hook (through DDP, which reports it as a RuntimeError naming it) or by
    # the mode switch's agreement at a step's start (as itself).
    assert name in ("CommunicationError", "CommunicationTimeout") or "CommunicationError" in message \
        or "CommunicationTimeout" in message, results[0]
    assert "peer" in message, message


def _with_timeline(rank, world_size, path):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    model = DDP(_model(), bucket_cap_mb=0.1)
    with bsp.ScheduledHookState(timeline=path, partition_bytes="16KiB") as state:
        model.register_comm_hook(state, bsp.scheduled_allreduce_hook)
        for _ in range(3):
            model(torch.randn(4, 3, 8, 8)).sum().backward()
    return True


def test_timeline_one_valid_trace_per_rank(tmp_path):
    path = str(tmp_path / "trace.json")
    run_ranks(_with_timeline, 2, (path,), deadline=120)
    for rank in range(2):
        with open(tmp_path / f"trace.rank{rank}.json") as handle:
            events = json.load(handle)
        categories = {e.get("cat") for e in events}
        assert {"task", "queue", "lane0"} <= categories or {"task", "queue", "lane1"} <= categories
        assert all(e["pid"] == rank for e in events)
        begins = sorted(e["id"] for e in events if e["ph"] == "b")
        ends = sorted(e["id"] for e in events if e["ph"] == "e")
        assert begins == ends and begins


def _bad_config(rank, world_size):
    import bytescheduler.pytorch as bsp

    try:
        bsp.ScheduledHookState(partition_bytes="four megabytes")
    except ValueError as error:
        return str(error)
    return "no error"


def test_bad_config_is_a_clear_value_error():
    for message in run_ranks(_bad_config, 2, deadline=60):
        assert "partition_bytes" in message and "4MB" in message


def _two_models(rank, world_size):
    """Two DDP models with a state each, trained in one loop (e.g. a GAN), then again."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp
    from bytescheduler.pytorch import ProcessGroups

    differences = []
    for _ in range(2):  # the second pass must reuse the groups of the first
        pairs = []
        states = []
        for _ in range(2):
            ours, theirs = DDP(_model(), bucket_cap_mb=0.05), DDP(_model(), bucket_cap_mb=0.05)
            theirs.register_comm_hook(None, default_hooks.allreduce_hook)
            state = bsp.ScheduledHookState(partition_bytes="8KiB", credit_bytes="32KiB")
            ours.register_comm_hook(state, bsp.scheduled_allreduce_hook)
            states.append(state)
            pairs.append((ours, theirs))
        data = torch.Generator().manual_seed(rank)
        for _ in range(10):
            x = torch.randn(8, 3, 8, 8, generator=data)
            for ours, theirs in pairs:
                for model in (ours, theirs):
                    model.zero_grad()
                    model(x).square().mean().backward()
                differences.append(max((a.grad - b.grad).abs().max().item()
                                       for a, b in zip(ours.parameters(), theirs.parameters())))
        for state in states:
            state.close()
    pools = {key[1:]: len(pool) for key, pool in ProcessGroups._pools.items()}
    return max(differences), pools


def test_two_states_at_once_and_reuse_of_groups():
    for difference, pools in run_ranks(_two_models, 2, deadline=180):
        assert difference == 0.0
        # Two states were alive at once, so two sets of groups; the second pass reused them.
        assert list(pools.values()) == [2], pools


def _dropped_hook(rank, world_size):
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    seen = {}
    for registered in (False, True):
        model = DDP(_model(), bucket_cap_mb=0.1)
        state = bsp.ScheduledHookState()
        if registered:
            model.register_comm_hook(state, bsp.scheduled_allreduce_hook)
        for _ in range(2):
            model(torch.randn(4, 3, 8, 8)).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state.close()
        seen[registered] = [str(w.message) for w in caught]
    return seen


def test_a_state_whose_hook_never_ran_warns_at_close():
    """A hook that was never registered (or that a framework dropped) is said, on every rank."""
    for seen in run_ranks(_dropped_hook, 2, deadline=120):
        assert any("saw no gradient bucket" in text and "register_comm_hook" in text for text in seen[False]), seen
        assert not any("saw no gradient bucket" in text for text in seen[True]), seen
