"""Plans: ``bytescheduler plan`` picks what can be worked out by hand, and the runtime follows a plan.

The planner is checked on profiles small enough to compute by hand; the plan file, its
place among the settings and the mode switch's start are unit-tested; then real gloo
processes show that a plan reaches the adapters: a plan that says "don't schedule" runs the
framework's own path from the first step, a plan given on rank 0 only sets every rank's sizes,
the online tuner starts at the plan's setting, and the numbers stay DDP's, bit for bit.
(Bad plan files are in tests/test_bad_inputs.py, with every other bad input.)
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bytescheduler.core.config import SchedulerConfig
from bytescheduler.core.modes import PLAIN, SCHEDULED, ModeChooser, ModeSwitchParams
from bytescheduler.core.plan import Plan, read_plan
from bytescheduler_tools.sim.network import Network
from bytescheduler_tools.sim.planner import search
from bytescheduler_tools.sim.profile import Layer, Profile, Tensor
from tests.distributed import run_ranks

STEPS = 12


def _two_layers():
    """Layer a's small gradient is ready last in backward; layer b's large one first."""
    return Profile("two", (Layer("a", 0.01, (Tensor(1_000, 0.095),)), Layer("b", 0.01, (Tensor(300_000, 0.0),))),
                   backward_s=0.1, step_s=0.0)


# --------------------------------------------------------------------------- the planner, by hand


def test_the_plan_cuts_the_large_tensor_so_the_urgent_one_overtakes_it():
    """2 ranks at 1 MB/s, no latency: 10 kB pieces take 10 ms each.

    - Whole (400 kB partition): b goes from the start of backward for 300 ms; a, ready at
      95 ms, waits behind it and ends at 301 ms; the next iteration's a and b forwards (10 ms
      each) follow: 0.321 s per iteration.
    - 10 kB pieces, one in flight: 10 of b's pieces are done when backward ends at 100 ms, a
      goes right after the piece in flight (100-101 ms), its forward runs while b's 20 other
      pieces go (101-301 ms), then b's forward: 0.311 s.
    - The framework's own path: one bucket of both, sent once a is ready: 20 + 95 + 301 ms.
    """
    config = SchedulerConfig(merge=False, fast_lane_bytes=0)
    plan = search(_two_layers(), Network(bandwidth=1e6, latency=0.0), 2, partitions=[10_000, 400_000],
                  credit_multiples=[1], config=config, iterations=10)
    assert plan.schedule and (plan.partition_bytes, plan.credit_bytes) == (10_000, 10_000)
    grid = {(row["partition_bytes"], row["credit_bytes"]): row["seconds"] for row in plan.details["grid"]}
    assert grid == {(10_000, 10_000): pytest.approx(0.311), (400_000, 400_000): pytest.approx(0.321)}
    assert plan.details["framework_seconds"] == pytest.approx(0.416)
    assert plan.details["predicted_speedup"] == pytest.approx(0.416 / 0.311)


def test_the_plan_takes_the_credit_that_lets_the_urgent_tensor_go_first():
    """Layer a's forward is long (100 ms), so its gradient's arrival decides the iteration; b
    has 15 pieces of 10 ms on one lane (first in, first out). a is ready at 95 ms:

    - credit of 1 piece: b's 10th piece runs (90-100 ms), a goes next (100-101), its forward
      (101-201), b's 5 other pieces end at 151, b's forward 201-211: 0.211 s;
    - credit of 2: the window is full, a is admitted at 100 behind b's queued 11th piece and
      runs 110-111: 0.221 s; of 4: behind three, 130-131: 0.241 s.
    """
    slow_first = Profile("two", (Layer("a", 0.1, (Tensor(1_000, 0.095),)), Layer("b", 0.01, (Tensor(150_000, 0.0),))),
                         backward_s=0.1, step_s=0.0)
    config = SchedulerConfig(merge=False, fast_lane_bytes=0)
    plan = search(slow_first, Network(bandwidth=1e6, latency=0.0), 2, partitions=[10_000],
                  credit_multiples=[4, 2, 1], config=config, iterations=10)
    grid = {row["credit_bytes"]: row["seconds"] for row in plan.details["grid"]}
    assert grid == {10_000: pytest.approx(0.211), 20_000: pytest.approx(0.221), 40_000: pytest.approx(0.241)}
    assert plan.schedule and plan.credit_bytes == 10_000


def test_the_plan_says_dont_schedule_when_no_setting_beats_the_framework():
    one = Profile("one", (Layer("x", 0.05, (Tensor(2_000_000, 0.2),)),), backward_s=0.2, step_s=0.01)
    plan = search(one, Network(bandwidth=1e7, latency=1e-4), 4, partitions=[1 << 20, 4 << 20], credit_multiples=[1, 4])
    # One tensor, ready at the end of backward: nothing to reorder, nothing to overlap.
    assert not plan.schedule
    assert plan.details["best_seconds"] == pytest.approx(plan.details["framework_seconds"], rel=1e-6)
    # Above the gain asked for, the same plan schedules.
    plan = search(_two_layers(), Network(bandwidth=1e6, latency=0.0), 2, partitions=[10_000], credit_multiples=[1],
                  config=SchedulerConfig(merge=False, fast_lane_bytes=0), min_gain=0.5)
    assert not plan.schedule  # 1.34x is not 1.5x


def test_plan_command_prints_a_table_and_writes_a_plan_the_runtime_reads(tmp_path, capsys):
    from bytescheduler.cli import main

    profile = tmp_path / "two.json"
    profile.write_text(_two_layers().to_json())
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(profile), "--ranks", "2", "--bandwidth", "8mbit", "--latency-us", "0",
                 "--partitions", "10000", "400000", "--credit-multiples", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "the framework's own path (ddp)" in text and "(the plan)" in text and "Recommendation: schedule" in text
    plan = read_plan(out)
    assert plan.schedule and plan.details["ranks"] == 2 and plan.details["model"] == "two"
    config = SchedulerConfig.resolve(environ={"BYTESCHEDULER_PLAN": str(out)})
    assert (config.partition_bytes, config.credit_bytes, config.start_plain) == \
        (plan.partition_bytes, plan.credit_bytes, False)


# --------------------------------------------------------------------------- the plan among the settings


def _write(path, schedule, partition, credit):
    path.write_text(Plan(schedule, partition, credit).to_json())
    return str(path)


def test_a_plan_replaces_the_defaults_and_explicit_settings_win(tmp_path):
    from bytescheduler.pytorch.optimizer import OPTIMIZER_DEFAULTS

    plain = _write(tmp_path / "plain.json", False, 1 << 20, 8 << 20)
    config = SchedulerConfig.build(defaults=OPTIMIZER_DEFAULTS, plan=plain)
    assert (config.partition_bytes, config.credit_bytes, config.start_plain, config.plan) == \
        (1 << 20, 8 << 20, True, plain)
    assert config.cycle_ms == OPTIMIZER_DEFAULTS.cycle_ms and config.adaptive  # the rest stays the adapter's
    # The environment and keywords still win over the plan, and a plan keyword over a plan variable.
    config = SchedulerConfig.resolve(environ={"BYTESCHEDULER_PLAN": plain, "BYTESCHEDULER_CREDIT": "2MiB"},
                                     partition_bytes="512KiB")
    assert (config.partition_bytes, config.credit_bytes, config.start_plain) == (512 << 10, 2 << 20, True)
    other = _write(tmp_path / "other.json", True, 4 << 20, 4 << 20)
    config = SchedulerConfig.resolve(environ={"BYTESCHEDULER_PLAN": plain}, plan=other)
    assert (config.partition_bytes, config.start_plain, config.plan) == (4 << 20, False, other)
    # A config object given explicitly takes the plan too (no environment then).
    config = SchedulerConfig(credit_bytes=1).with_options(plan=plain, timeout=5)
    assert (config.credit_bytes, config.timeout) == (8 << 20, 5.0)


def test_a_plain_start_holds_the_plain_path_then_tries_the_schedule():
    chooser = ModeChooser(ModeSwitchParams(warmup=1, settle=0, trial=2, pairs=1, hold=3, min_retrial=2), start=PLAIN)
    times = {SCHEDULED: 0.5, PLAIN: 1.0}
    for _ in range(10):
        chooser.record(times[chooser.mode])
        if chooser.end_step():
            chooser.adopt(chooser.propose())
    # 3 plain steps (the plan's hold, no warm-up, no trials), the scheduled re-trial (2), back
    # on plain (2), then the faster scheduled path is held.
    assert "".join(m[0] for m in chooser.history) == "ppp" "ss" "pp" "sss"
    assert chooser.choices == 2
    with pytest.raises(ValueError, match="start must be"):
        ModeChooser(start="fast")


# --------------------------------------------------------------------------- the plan in real processes


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(),
                         nn.Linear(32, 10))


def _same(ours, theirs):
    """Names of parameters that differ from DDP's, bit for bit."""
    return [name for (name, a), (_, b) in zip(ours.named_parameters(), theirs.module.named_parameters())
            if not torch.equal(a, b)]


def _train(rank, ours, optimizer, theirs, baseline, steps=STEPS, each=None):
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(8, 3, 8, 8, generator=data)
        y = torch.randint(0, 10, (8,), generator=data)
        for model, opt in ((ours, optimizer), (theirs, baseline)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if each is not None:
            each()


def _pair(**options):
    import bytescheduler.pytorch as bsp
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ours = _mlp()
    torch.manual_seed(0)
    theirs = DDP(_mlp())
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    return ours, bsp.ScheduledOptimizer(ours, sgd(ours.parameters()), **options), theirs, sgd(theirs.parameters())


def _plain_plan(rank, plan):
    ours, optimizer, theirs, baseline = _pair(plan=plan)
    engine = optimizer._bytescheduler
    plain_steps = []
    _train(rank, ours, optimizer, theirs, baseline, each=lambda: plain_steps.append(engine.plain))
    optimizer.synchronize()
    out = dict(same=_same(ours, theirs), plain=plain_steps, first=engine.chooser.history[0],
               operations=engine.scheduler.stats["operations"], start_plain=engine.scheduler.config.start_plain)
    optimizer.close()
    return out


def _plan_on_rank_0(rank, plan):
    """Rank 0 alone is given the plan (16 KiB pieces, 64 KiB credit); rank 1 its defaults."""
    ours, optimizer, theirs, baseline = _pair(plan=plan if rank == 0 else None, adaptive=False)
    _train(rank, ours, optimizer, theirs, baseline)
    optimizer.synchronize()
    config = optimizer._bytescheduler.scheduler.config
    stats = optimizer._bytescheduler.scheduler.stats
    out = dict(same=_same(ours, theirs), sizes=(config.partition_bytes, config.credit_bytes), plan=config.plan,
               pieces=stats["pieces"], tensors=len(list(ours.parameters())))
    optimizer.close()
    return out


def _tuner_from_plan(rank, plan):
    ours, optimizer, theirs, baseline = _pair(plan=plan, auto_tune=True)
    tuner = optimizer._bytescheduler.scheduler.tuner
    start = None if tuner is None else tuner.trial
    _train(rank, ours, optimizer, theirs, baseline, steps=20)
    optimizer.synchronize()
    out = dict(same=_same(ours, theirs), start=start,
               trials=None if tuner is None else [(t.partition_bytes, t.credit_bytes) for t in tuner.history])
    optimizer.close()
    return out


def _hook_plain_plan(rank, plan):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    torch.manual_seed(0)
    ours = DDP(_mlp())
    torch.manual_seed(0)
    theirs = DDP(_mlp())
    state = bsp.ScheduledHookState(plan=plan)
    ours.register_comm_hook(state, bsp.scheduled_allreduce_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    plain = []
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(8, 3, 8, 8, generator=data)
        y = torch.randint(0, 10, (8,), generator=data)
        for model, opt in zip((ours, theirs), optimizers):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        plain.append(state.plain)
    out = dict(same=[n for (n, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters())
                     if not torch.equal(a, b)],
               plain=plain, operations=state.scheduler.stats["operations"])
    state.close()
    return out


def _cases(rank, world_size, plans):
    return {"plain": _plain_plan(rank, plans["plain"]), "rank0": _plan_on_rank_0(rank, plans["small"]),
            "tuner": _tuner_from_plan(rank, plans["small"]), "hook": _hook_plain_plan(rank, plans["plain"])}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    plans = {"plain": _write(folder / "plain.json", False, 16 << 10, 64 << 10),
             "small": _write(folder / "small.json", True, 16 << 10, 64 << 10)}
    return run_ranks(_cases, 2, (plans,), deadline=240)


def test_a_dont_schedule_plan_runs_the_framework_path_from_the_first_step_with_ddps_numbers(planned):
    for rank in planned:
        out = rank["plain"]
        assert out["same"] == [], out["same"]
        assert out["start_plain"] and out["first"] == PLAIN
        assert out["plain"] == [True] * STEPS  # held: the scheduled path is tried after 200 steps
        assert out["operations"] == 0  # nothing went through the scheduler


def test_a_plan_given_to_rank_0_sets_every_ranks_sizes(planned):
    leader, follower = planned[0]["rank0"], planned[1]["rank0"]
    for out in (leader, follower):
        assert out["same"] == [], out["same"]
        assert out["sizes"] == (16 << 10, 64 << 10)
        assert out["pieces"] > STEPS * out["tensors"]  # the 16 KiB pieces of the plan were cut
    assert leader["plan"] is not None and follower["plan"] is None  # read on rank 0 only


def test_the_tuner_starts_at_the_plans_setting_and_keeps_ddps_numbers(planned):
    leader, follower = planned[0]["tuner"], planned[1]["tuner"]
    assert leader["same"] == [] and follower["same"] == []
    assert leader["start"] == (16 << 10, 64 << 10)
    assert leader["trials"][0] == (16 << 10, 64 << 10) and len(leader["trials"]) >= 2, leader["trials"]
    assert follower["trials"] is None  # only rank 0 tunes


def test_the_hook_follows_a_dont_schedule_plan_with_ddps_numbers(planned):
    for rank in planned:
        out = rank["hook"]
        assert out["same"] == [], out["same"]
        assert out["plain"] == [True] * STEPS and out["operations"] == 0


def test_plan_json_is_what_the_planner_wrote(tmp_path):
    plan = search(_two_layers(), Network(bandwidth=1e6, latency=0.0), 2, partitions=[10_000], credit_multiples=[1])
    path = tmp_path / "p.json"
    path.write_text(plan.to_json())
    data = json.loads(path.read_text())
    assert data["format"] == "bytescheduler-plan" and data["version"] == 1
    assert read_plan(path) == plan and read_plan(path).details["grid"] == plan.details["grid"]
