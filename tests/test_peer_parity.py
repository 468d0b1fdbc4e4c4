"""Peer parity: the framework's own numbers in the loops PyTorch's and Horovod's tests check.

Each scenario of :mod:`tests.parity` trains a model with the framework's own path (DDP, or
``hvd.DistributedOptimizer``) and with each of our adapters it applies to, side by side on
real processes (gloo on 127.0.0.1; Horovod under horovodrun), and compares parameters,
gradients (and whether there is one), buffers and losses: bit for bit on 2 ranks (a sum
of two values is exact in any order), within 1e-6 on 3 and 4 where the reduction order
differs. Every run carries a deadline and short timeouts, so a hang fails fast.

One spawn runs a whole table of scenarios (processes cost seconds each); each test then
asserts its own scenario's row.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List

import pytest

from tests.distributed import run_ranks
from tests.parity import PLAIN, SCHEDULED, Scenario

HERE = os.path.dirname(os.path.abspath(__file__))
UNUSED = ("one-rank", "all-ranks", "rank0")

# ScheduledOptimizer against DistributedDataParallel.
OPTIMIZER_SCENARIOS = [
    Scenario("unused-one-rank-scheduled", plan="one-rank", ours=SCHEDULED),
    Scenario("unused-one-rank-plain", plan="one-rank", ours=PLAIN),
    Scenario("unused-one-rank-switching", plan="one-rank"),
    Scenario("unused-all-ranks-scheduled", plan="all-ranks", optimizer="adam", ours=SCHEDULED),
    Scenario("unused-all-ranks-plain", plan="all-ranks", optimizer="adam", ours=PLAIN),
    Scenario("unused-rank0-scheduled", plan="rank0", ours=SCHEDULED),
    Scenario("unused-kept-zero-gradients", plan="all-ranks", set_to_none=False, ours=SCHEDULED),
    Scenario("unused-accumulated", plan="all-ranks", passes=2, ours=SCHEDULED),
    Scenario("unused-accumulated-plain", plan="one-rank", passes=2, ours=PLAIN),
    Scenario("unused-clipped", plan="one-rank", clip=True, ours=SCHEDULED),
    Scenario("experts-scheduled", model="experts", optimizer="adamw", ours=SCHEDULED),
    # Longer: its step 26 is one where rank 1 needs an expert rank 0 skipped the step before
    # (an operation merging two iterations' gradients deadlocked there).
    Scenario("experts-switching", model="experts", steps=28),
    Scenario("experts-checkpoint", model="experts", optimizer="adam", checkpoint=True, ours=SCHEDULED),
    Scenario("batchnorm-buffers", model="convbn", ours=SCHEDULED),
    Scenario("batchnorm-buffers-plain", model="convbn", ours=PLAIN),
    Scenario("batchnorm-buffers-eval", model="convbn", evaluate=True, ours=SCHEDULED),
    Scenario("batchnorm-buffers-accumulated", model="convbn", passes=2, ours=SCHEDULED),
    Scenario("batchnorm-buffers-off", model="convbn", ours=dict(SCHEDULED, broadcast_buffers=False),
             theirs=dict(broadcast_buffers=False)),
    Scenario("channels-last", model="convbn", channels_last=True, ours=SCHEDULED),
    Scenario("tied-weights", model="tied", optimizer="adam", ours=SCHEDULED),
    Scenario("two-dtypes", model="two-dtypes", ours=SCHEDULED),
    Scenario("lr-schedule", optimizer="sgd-nesterov", schedule=True, ours=SCHEDULED),
    Scenario("rmsprop", optimizer="rmsprop", plan="one-rank", ours=SCHEDULED),
    Scenario("adagrad", optimizer="adagrad", plan="one-rank", ours=SCHEDULED),
    # Models someone else wrote: Hugging Face's GPT-2 (tied embeddings) and BERT.
    Scenario("hf-gpt2", model="hf-gpt2", optimizer="adamw", ours=SCHEDULED),
    Scenario("hf-gpt2-switching", model="hf-gpt2", optimizer="adamw"),
    Scenario("hf-bert", model="hf-bert", optimizer="adamw", clip=True, ours=SCHEDULED),
]

# Uneven inputs: ScheduledOptimizer under torch's Join against DDP under Join.
JOIN_SCENARIOS = [
    Scenario("join-rank0-first", join="first", ours=SCHEDULED),
    Scenario("join-last-first", join="last", optimizer="adam", ours=SCHEDULED),
    Scenario("join-plain", join="first", ours=PLAIN),
    Scenario("join-switching", join="last"),
    Scenario("join-unused", join="first", plan="one-rank", ours=SCHEDULED),
    Scenario("join-unused-rank0", join="last", plan="rank0", ours=SCHEDULED),
]

# The scheduled DDP communication hook against DDP's own all-reduce.
HOOK_SCENARIOS = [
    Scenario("hook-unused-one-rank", plan="one-rank", theirs=dict(find_unused_parameters=True)),
    Scenario("hook-unused-all-ranks", plan="all-ranks", theirs=dict(find_unused_parameters=True)),
    Scenario("hook-experts", model="experts", theirs=dict(find_unused_parameters=True)),
    Scenario("hook-batchnorm", model="convbn"),
    Scenario("hook-static-graph", theirs=dict(static_graph=True)),
    Scenario("hook-hf-gpt2", model="hf-gpt2", optimizer="adamw"),
    Scenario("hook-hf-bert", model="hf-bert", optimizer="adamw"),
]

BY_NAME: Dict[str, Scenario] = {s.name: s for s in OPTIMIZER_SCENARIOS + JOIN_SCENARIOS + HOOK_SCENARIOS}


# --------------------------------------------------------------------------- on each rank


def _optimizer_pair(rank: int, scenario: Scenario, tolerance: float) -> List[str]:
    import contextlib

    import torch
    from torch.distributed.algorithms import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp
    from tests.parity import OPTIMIZERS, differences, run_loop, seeded

    unused = scenario.plan != "none" or scenario.model == "experts"
    ours = seeded(scenario)
    theirs = DDP(seeded(scenario), find_unused_parameters=unused, **scenario.theirs)
    options = dict(scenario.ours)
    optimizer = bsp.ScheduledOptimizer(ours, OPTIMIZERS[scenario.optimizer](ours.parameters()),
                                       backward_passes_per_step=scenario.passes, timeout=30, **options)
    baseline = OPTIMIZERS[scenario.optimizer](theirs.parameters())
    joined = (lambda joinable: Join([joinable])) if scenario.join else (lambda joinable: contextlib.nullcontext())
    try:
        with joined(optimizer):
            our_losses = run_loop(scenario, rank, ours, ours, optimizer, optimizer.synchronize)
        optimizer.synchronize()
        with joined(theirs):
            their_losses = run_loop(scenario, rank, theirs.module, theirs, baseline, lambda: None, theirs.no_sync)
        if scenario.join:  # after a join the gradients are each rank's own: compare the models
            for model in (ours, theirs.module):
                model.zero_grad(set_to_none=True)
        found = differences(ours, theirs.module, tolerance)
        if our_losses != their_losses and tolerance == 0.0:
            found.append("losses")
        moved = any(not torch.equal(p, q) for p, q in zip(ours.parameters(), seeded(scenario).parameters()))
        if not moved:
            found.append("training did not change the parameters")
        return found
    finally:
        optimizer.close()


def _hook_pair(rank: int, scenario: Scenario, tolerance: float) -> List[str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp
    from tests.parity import OPTIMIZERS, differences, run_loop, seeded

    ours = DDP(seeded(scenario), **scenario.theirs)
    theirs = DDP(seeded(scenario), **scenario.theirs)
    state = bsp.ScheduledHookState(model=ours, timeout=30, **scenario.ours)
    ours.register_comm_hook(state, bsp.scheduled_allreduce_hook)
    optimizer = OPTIMIZERS[scenario.optimizer](ours.parameters())
    baseline = OPTIMIZERS[scenario.optimizer](theirs.parameters())
    try:
        our_losses = run_loop(scenario, rank, ours.module, ours, optimizer, lambda: None, ours.no_sync)
        their_losses = run_loop(scenario, rank, theirs.module, theirs, baseline, lambda: None, theirs.no_sync)
        found = differences(ours.module, theirs.module, tolerance)
        if our_losses != their_losses and tolerance == 0.0:
            found.append("losses")
        return found
    finally:
        state.close()


def _table(rank: int, world_size: int, names: List[str], tolerance: float) -> Dict[str, List[str]]:
    table = {}
    for name in names:
        scenario = BY_NAME[name]
        print(f"rank {rank}: scenario {name}", file=sys.stderr, flush=True)
        pair = _hook_pair if name.startswith("hook-") else _optimizer_pair
        table[name] = pair(rank, scenario, tolerance)
    return table


def _assert_row(tables: List[Dict[str, List[str]]], name: str) -> None:
    for rank, table in enumerate(tables):
        assert table[name] == [], f"{name}, rank {rank}: differs from the framework's own path: {table[name]}"


# --------------------------------------------------------------------------- torch.distributed


@pytest.fixture(scope="module")
def two_ranks():
    names = [s.name for s in OPTIMIZER_SCENARIOS + JOIN_SCENARIOS + HOOK_SCENARIOS]
    return run_ranks(_table, world_size=2, args=(names, 0.0), deadline=600)


@pytest.mark.parametrize("name", [s.name for s in OPTIMIZER_SCENARIOS])
def test_scheduled_optimizer_gives_ddps_numbers(two_ranks, name):
    _assert_row(two_ranks, name)


@pytest.mark.parametrize("name", [s.name for s in JOIN_SCENARIOS])
def test_scheduled_optimizer_under_join_gives_ddps_numbers(two_ranks, name):
    _assert_row(two_ranks, name)


@pytest.mark.parametrize("name", [s.name for s in HOOK_SCENARIOS])
def test_scheduled_hook_gives_ddps_numbers(two_ranks, name):
    _assert_row(two_ranks, name)


MANY_RANKS = ["unused-all-ranks-scheduled", "unused-rank0-scheduled", "unused-all-ranks-plain", "experts-switching",
              "join-rank0-first", "join-last-first", "join-unused"]


@pytest.mark.parametrize("world_size", [3, 4])
def test_unused_parameters_on_more_ranks(world_size):
    tables = run_ranks(_table, world_size=world_size, args=(MANY_RANKS, 1e-6), deadline=300)
    for name in MANY_RANKS:
        _assert_row(tables, name)


# --------------------------------------------------------------------------- Horovod


HOROVOD_WORKER = os.path.join(HERE, "parity_horovod_worker.py")


def _horovod_names() -> List[str]:
    sys.path.insert(0, HERE)
    try:
        from tests.parity_horovod_worker import SCENARIOS  # noqa: PLC0415 - imports horovod
    finally:
        sys.path.remove(HERE)
    return [s.name for s in SCENARIOS]


def _horovod_tables(ranks: int, args: List[str], deadline: float) -> List[Dict[str, List[str]]]:
    """The worker's tables of ``ranks`` ranks under horovodrun (``args``: its arguments)."""
    import subprocess

    from tests.test_horovod import BIN, ROOT, _communicate, _env, results

    command = [os.path.join(BIN, "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
               sys.executable, HOROVOD_WORKER, *args]
    process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    stdout, stderr = _communicate(process, deadline, "the Horovod parity table")
    assert process.returncode == 0, f"exit code {process.returncode}\n{stdout[-4000:]}\n{stderr[-4000:]}"
    found = results(stdout)
    assert sorted(found) == list(range(ranks)), stdout[-4000:]
    return [found[rank]["table"] for rank in range(ranks)]


@pytest.fixture(scope="module")
def horovod_table():
    return _horovod_tables(2, [], 300)


@pytest.mark.parametrize("name", _horovod_names())
def test_scheduled_optimizer_gives_horovods_numbers(horovod_table, name):
    _assert_row(horovod_table, name)


HOROVOD_MANY_RANKS = ["horovod-unused-one-rank", "horovod-unused-all-ranks", "horovod-unused-rank0",
                      "horovod-experts-switching", "horovod-join-rank0-first", "horovod-join-last-first",
                      "horovod-join-plain", "horovod-join-switching", "horovod-join-unused", "horovod-join-epochs"]


@pytest.mark.parametrize("ranks", [3, 4])
def test_horovod_unused_parameters_and_join_on_more_ranks(ranks):
    """Within 1e-6 (Horovod's fusion and our pieces sum more than two ranks in different orders)."""
    tables = _horovod_tables(ranks, ["--tolerance=1e-6", *HOROVOD_MANY_RANKS], 300)
    for name in HOROVOD_MANY_RANKS:
        _assert_row(tables, name)


def _join_refusals(rank: int, world_size: int) -> List[str]:
    import torch
    from torch.distributed.algorithms import Join

    import bytescheduler.pytorch as bsp
    from tests.parity import ConvBN

    said = []
    model = ConvBN()
    optimizer = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), timeout=30)
    try:
        Join([optimizer])
    except ValueError as error:
        said.append(str(error))
    optimizer.close()
    quiet = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), broadcast_buffers=False,
                                   timeout=30)
    Join([quiet])  # accepted
    quiet.close()
    return said


def test_join_refuses_what_it_cannot_do_like_ddp_on_every_rank():
    for said in run_ranks(_join_refusals, world_size=2, deadline=120):
        assert len(said) == 1 and "broadcast_buffers=False" in said[0], said
