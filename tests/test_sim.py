"""The simulator on cases small enough to check by hand, and its use of the runtime's own policy."""

import json

import pytest

from bytescheduler.core.config import SchedulerConfig
from bytescheduler.sim.engine import Link, ddp_buckets, simulate
from bytescheduler.sim.network import Network, parse_rate
from bytescheduler.sim.profile import Layer, Profile, Tensor


def test_ring_and_tree_cost_for_n_ranks():
    net = Network(bandwidth=1e6, latency=1e-3)
    # ring: 2(n-1) steps, 2(n-1)/n of the bytes each way
    assert net.allreduce_seconds(800_000, 2) == pytest.approx(2 * 1e-3 + 0.8)
    assert net.allreduce_seconds(800_000, 8) == pytest.approx(14 * 1e-3 + 2 * 7 / 8 * 0.8)
    assert net.allreduce_seconds(800_000, 1) == 0.0
    tree = Network(bandwidth=1e6, latency=1e-3, algorithm="tree")
    assert tree.allreduce_seconds(800_000, 8) == pytest.approx(6 * 1e-3 + 1.6)
    assert parse_rate("1gbit") == 125e6 and parse_rate("500mbit") == 62.5e6
    with pytest.raises(ValueError, match="not a rate"):
        parse_rate("fast")


def test_one_tensor_every_system_by_hand():
    profile = Profile("one", (Layer("x", 0.05, (Tensor(2_000_000, 0.2),)),), backward_s=0.2, step_s=0.01)
    net = Network(bandwidth=1e7, latency=1e-4)
    comm = 6 * 1e-4 + 1.5 * 2_000_000 / 1e7  # 4 ranks
    expected = 0.05 + 0.2 + comm + 0.01
    assert simulate(profile, net, 4, "compute").seconds == pytest.approx(0.26)
    for system in ("ddp", "ddp-hook", "scheduled"):
        assert simulate(profile, net, 4, system).seconds == pytest.approx(expected), system


def test_a_late_urgent_gradient_overtakes_queued_pieces():
    """Layer a's small gradient, ready last, goes right after the piece in flight of b's 30."""
    profile = Profile("two", (Layer("a", 0.01, (Tensor(1_000, 0.095),)), Layer("b", 0.01, (Tensor(300_000, 0.0),))),
                      backward_s=0.1, step_s=0.0)
    net = Network(bandwidth=1e6, latency=0.0)  # 2 ranks: a piece of 10 kB takes 10 ms
    config = SchedulerConfig(partition_bytes=10_000, credit_bytes=10_000, merge=False, fast_lane_bytes=0)
    scheduled = simulate(profile, net, 2, "scheduled", config, iterations=10)
    # Steady state: a's forward, then b's waits for b's last piece; backward; a goes 1 ms after
    # the backward ends (behind one piece), and the next iteration starts then.
    assert scheduled.seconds == pytest.approx(0.311)
    ddp = simulate(profile, net, 2, "ddp")
    assert ddp.seconds == pytest.approx(0.02 + 0.095 + 0.301)  # one bucket, sent once a is ready
    assert scheduled.operations == pytest.approx(31)


def test_the_credit_bounds_bytes_in_flight(monkeypatch):
    from bytescheduler.core import policy as policy_module

    peaks = []
    real_decide = policy_module.SchedulingPolicy.decide

    def decide(self, now):
        ops = real_decide(self, now)
        peaks.append(self.main.in_flight)
        return ops

    # The simulator must drive the runtime's own policy object, not a copy of its rules.
    monkeypatch.setattr(policy_module.SchedulingPolicy, "decide", decide)
    layers = tuple(Layer(f"l{i}", 0.01, (Tensor(3_000_000, 0.01 * (5 - i)),)) for i in range(5))
    profile = Profile("five", layers, backward_s=0.05, step_s=0.0)
    config = SchedulerConfig(partition_bytes=1_000_000, credit_bytes=2_000_000, fast_lane_bytes=0)
    result = simulate(profile, Network(bandwidth=1e8), 2, "scheduled", config)
    assert peaks and max(peaks) <= 2_000_000
    assert max(peaks) == 2_000_000  # the credit is used
    assert result.operations == pytest.approx(15)


def test_link_shares_its_rate_between_busy_lanes():
    link = Link(2)
    ended = []
    link.launch(0, 1.0, lambda t: ended.append(("a", t)))
    link.launch(1, 0.5, lambda t: ended.append(("b", t)))
    link.launch(1, 0.5, lambda t: ended.append(("c", t)))
    while link.next_end() is not None:
        for finish, done in link.advance(link.next_end()):
            done(finish)
    # b ends at 1.0 (half the rate), then c shares with a's remaining 0.5: both end at 2.0.
    assert ended == [("b", pytest.approx(1.0)), ("a", pytest.approx(2.0)), ("c", pytest.approx(2.0))]
    assert link.busy == pytest.approx(2.0)


def test_ddp_buckets_follow_ddp_first_small_then_25_mib():
    layers = tuple(Layer(f"l{i}", 0.0, (Tensor(600_000, 0.1 * (3 - i)),)) for i in range(4))
    buckets = ddp_buckets(Profile("four", layers, 0.4, 0.0))
    # reverse order: l3, l2 close the first (1 MiB) bucket; l1, l0 go in the next
    assert [b.nbytes for b in buckets] == [1_200_000, 1_200_000]
    assert [b.layers for b in buckets] == [(2, 3), (0, 1)]
    assert [b.ready_s for b in buckets] == [pytest.approx(0.1), pytest.approx(0.3)]


def test_default_settings_are_the_adapters():
    from bytescheduler.pytorch.ddp_hook import HOOK_DEFAULTS
    from bytescheduler.pytorch.optimizer import OPTIMIZER_DEFAULTS
    from bytescheduler.sim.engine import default_config

    assert default_config("ddp-hook") == HOOK_DEFAULTS
    assert default_config("scheduled") == OPTIMIZER_DEFAULTS


def test_simulate_command_reads_a_profile_and_writes_json(tmp_path, capsys):
    from bytescheduler.cli import main

    profile = Profile("one", (Layer("x", 0.05, (Tensor(2_000_000, 0.2),)),), backward_s=0.2, step_s=0.01)
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    out = tmp_path / "out.json"
    assert main(["simulate", "--profile", str(path), "--ranks", "2", "4", "--bandwidth", "1gbit",
                 "--systems", "ddp", "scheduled", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| 4 | 1gbit | scheduled |" in table and "| 2 | 1gbit | ddp |" in table
    rows = json.loads(out.read_text())["predictions"]
    assert [(r["ranks"], r["system"]) for r in rows] == [(2, "ddp"), (2, "scheduled"), (4, "ddp"), (4, "scheduled")]
    with pytest.raises(SystemExit):
        main(["simulate", "--profile", str(path), "--systems", "nothing"])


def test_a_bench_model_is_profiled_here():
    from bytescheduler.sim.profile import measure

    profile = measure("tiny", batch_size=4, iterations=2, warmup=1)
    assert [t.nbytes for layer in profile.layers for t in layer.tensors] == [3072 * 64 * 4, 64 * 4, 64 * 10 * 4, 40]
    assert profile.forward_s > 0 and profile.backward_s > 0
    assert all(0 <= t.ready_s <= profile.backward_s * 1.5 for layer in profile.layers for t in layer.tensors)
