"""The simulator on cases small enough to check by hand, and its use of the runtime's own policy."""

import json

import pytest

from bytescheduler.core.config import SchedulerConfig
from bytescheduler_tools.sim.allreduce import GlooLanes, ddp_buckets
from bytescheduler_tools.sim.engine import default_config, simulate
from bytescheduler_tools.sim.events import Simulation
from bytescheduler_tools.sim.network import Network, parse_rate
from bytescheduler_tools.sim.profile import Layer, Profile, Tensor


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


@pytest.fixture
def in_flight_after_decide(monkeypatch):
    """Every decision of the runtime's policy class, seen from outside: the bytes in flight on
    its main lane after each ``decide`` (the simulator must drive that very class)."""
    from bytescheduler.core import policy as policy_module

    seen = []
    real_decide = policy_module.SchedulingPolicy.decide

    def decide(self, now):
        ops = real_decide(self, now)
        seen.append(self.main.in_flight)
        return ops

    monkeypatch.setattr(policy_module.SchedulingPolicy, "decide", decide)
    return seen


def test_the_credit_bounds_bytes_in_flight(in_flight_after_decide):
    peaks = in_flight_after_decide
    layers = tuple(Layer(f"l{i}", 0.01, (Tensor(3_000_000, 0.01 * (5 - i)),)) for i in range(5))
    profile = Profile("five", layers, backward_s=0.05, step_s=0.0)
    config = SchedulerConfig(partition_bytes=1_000_000, credit_bytes=2_000_000, fast_lane_bytes=0)
    result = simulate(profile, Network(bandwidth=1e8), 2, "scheduled", config)
    assert peaks and max(peaks) <= 2_000_000
    assert max(peaks) == 2_000_000  # the credit is used
    assert result.operations == pytest.approx(15)


def test_lanes_share_the_link_between_busy_lanes():
    sim = Simulation({"link": 1.0})
    lanes = GlooLanes(sim, Network(bandwidth=1e6, latency=0.0), 2, calibration=None)
    ended = []
    lanes.launch(0, 1_000_000, lambda t: ended.append(("a", t)))  # 1 s alone (2 ranks: 1x the bytes)
    lanes.launch(1, 500_000, lambda t: ended.append(("b", t)))
    lanes.launch(1, 500_000, lambda t: ended.append(("c", t)))
    sim.run_until(lambda: len(ended) == 3)
    # b ends at 1.0 (half the rate), then c shares with a's remaining 0.5: both end at 2.0.
    assert ended == [("b", pytest.approx(1.0)), ("a", pytest.approx(2.0)), ("c", pytest.approx(2.0))]
    assert sim.busy("link") == pytest.approx(2.0)


def test_ddp_buckets_follow_ddp_first_small_then_25_mib():
    layers = tuple(Layer(f"l{i}", 0.0, (Tensor(600_000, 0.1 * (3 - i)),)) for i in range(4))
    buckets = ddp_buckets(Profile("four", layers, 0.4, 0.0))
    # reverse order: l3, l2 close the first (1 MiB) bucket; l1, l0 go in the next
    assert [b.nbytes for b in buckets] == [1_200_000, 1_200_000]
    assert [b.keys for b in buckets] == [(3, 2), (1, 0)]
    assert [b.layers for b in buckets] == [(2, 3), (0, 1)]


def test_default_settings_are_the_adapters():
    from bytescheduler.pytorch.ddp_hook import HOOK_DEFAULTS
    from bytescheduler.pytorch.horovod import HOROVOD_DEFAULTS
    from bytescheduler.pytorch.optimizer import OPTIMIZER_DEFAULTS

    assert default_config("ddp-hook") == HOOK_DEFAULTS
    assert default_config("scheduled") == OPTIMIZER_DEFAULTS
    assert default_config("hvd-scheduled") == HOROVOD_DEFAULTS  # ScheduledKVStore's: tests/mxnet/test_sim_ps.py


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
    from bytescheduler_tools.sim.profile import measure

    profile = measure("tiny", batch_size=4, iterations=2, warmup=1)
    assert [t.nbytes for layer in profile.layers for t in layer.tensors] == [3072 * 64 * 4, 64 * 4, 64 * 10 * 4, 40]
    assert profile.forward_s > 0 and profile.backward_s > 0
    assert all(0 <= t.ready_s <= profile.backward_s * 1.5 for layer in profile.layers for t in layer.tensors)


# ---------------------------------------------------------------------------- Horovod


def test_horovod_one_tensor_waits_for_the_next_cycle():
    """A gradient queued between two turns goes at the next one; the op runs on the one thread,
    so the turns after it are counted from its end."""
    profile = Profile("one", (Layer("x", 0.0105, (Tensor(2_000_000, 0.2),)),), backward_s=0.2, step_s=0.01)
    net = Network(bandwidth=1e7, latency=0.0)  # 2 ranks: the all-reduce moves 2 MB in 0.2 s
    result = simulate(profile, net, 2, "hvd", iterations=6)
    # Turns every 1 ms from the end of the last operation, which the step (10 ms) follows:
    # the gradient is ready 220.5 ms into that grid, so it waits 0.5 ms for the turn at 221.
    assert result.seconds == pytest.approx(0.0105 + 0.2 + 0.0005 + 0.2 + 0.01)
    assert result.operations == pytest.approx(1)


def test_horovod_fuses_tensors_of_one_turn_and_pays_the_fixed_cost_once():
    both_ready = Profile("two", (Layer("x", 0.01, (Tensor(1_000_000, 0.105), Tensor(1_000_000, 0.105))),),
                         backward_s=0.105, step_s=0.0)
    apart = Profile("two", (Layer("x", 0.01, (Tensor(1_000_000, 0.05), Tensor(1_000_000, 0.105))),),
                    backward_s=0.105, step_s=0.0)
    # 10 ms fixed per all-reduce, the turn's negotiation (a small all-reduce) included: a turn
    # then takes 10 ms, longer than the 1 ms cycle, so turns follow each other.
    net = Network(bandwidth=1e7, latency=0.0, op_seconds=0.01)
    fused = simulate(both_ready, net, 2, "hvd", iterations=6)
    assert fused.operations == pytest.approx(1)  # one response of both tensors
    # The next forward starts when the op ends, and so does the turn grid: both gradients are
    # ready 115 ms later, halfway through a turn; the next turn (120 ms) negotiates (10 ms),
    # then one all-reduce: 10 ms fixed and 2 MB in 0.2 s.
    assert fused.seconds == pytest.approx(0.01 + 0.105 + 0.005 + 0.01 + 0.01 + 0.2)
    separate = simulate(apart, net, 2, "hvd", iterations=6)
    assert separate.operations == pytest.approx(2)


def test_horovod_scheduled_hands_the_policys_pieces_to_horovods_cycle():
    profile = Profile("one", (Layer("x", 0.01, (Tensor(32 * 2**20, 0.1),)),), backward_s=0.1, step_s=0.0)
    result = simulate(profile, Network(bandwidth=1e9, latency=0.0), 2, "hvd-scheduled", iterations=6)
    assert result.operations == pytest.approx(4)  # 8 MiB pieces (the adapter's default)
    assert result.plain_seconds is not None and result.plain_seconds > 0  # Horovod's own path


# ---------------------------------------------------------------------------- parameter server


def test_ps_one_server_of_its_own_carries_every_workers_push():
    """One key (small: one server), 2 workers, a server on a machine of its own: its downlink
    takes both pushes (2x the bytes), its uplink both replies; the server updates in between."""
    profile = Profile("one", (Layer("x", 0.01, (Tensor(400_000, 0.1),)),), backward_s=0.1, step_s=0.02)
    result = simulate(profile, Network(bandwidth=1e7, latency=0.0, servers=1), 2, "ps", iterations=6)
    push = reply = 2 * 400_000 / 1e7
    assert result.seconds == pytest.approx(0.01 + 0.1 + push + 0.02 + reply)  # the update: the step's time


def test_ps_servers_on_the_ranks_machines_and_a_key_split_over_two():
    big = Profile("big", (Layer("x", 0.01, (Tensor(8_000_000, 0.1),)),), backward_s=0.1, step_s=0.0)
    # 2M elements: MXNet splits the key over both servers; each worker's link carries half of
    # its push to the other machine's server and half of that server's replies back.
    on_ranks = simulate(big, Network(bandwidth=1e7, latency=0.0), 2, "ps", iterations=6)
    assert on_ranks.seconds == pytest.approx(0.01 + 0.1 + 0.4 + 0.4)
    two_servers = simulate(big, Network(bandwidth=1e7, latency=0.0, servers=2), 2, "ps", iterations=6)
    # Servers of their own: each worker sends all 8 MB (0.8 s); each server takes 2 x 4 MB.
    assert two_servers.seconds == pytest.approx(0.01 + 0.1 + 0.8 + 0.8)
    one_server = simulate(big, Network(bandwidth=1e7, latency=0.0, servers=1), 2, "ps", iterations=6)
    assert one_server.seconds == pytest.approx(0.01 + 0.1 + 1.6 + 1.6)  # its link takes both workers'


def test_ps_scheduled_sends_pieces_of_whole_subkeys():
    profile = Profile("one", (Layer("x", 0.01, (Tensor(16 * 2**20, 0.1),)),), backward_s=0.1, step_s=0.0)
    # a slow link (800 Mbit/s), where the store keeps its 4 MiB sub-keys (whole keys on a fast one)
    result = simulate(profile, Network(bandwidth=1e8, latency=0.0), 2, "ps-scheduled", iterations=6)
    assert result.operations == pytest.approx(4)  # four 4 MiB sub-keys, one piece each
    assert simulate(profile, Network(bandwidth=1e9, latency=0.0), 2, "mxnet-scheduled").system == "mxnet-scheduled"


# ---------------------------------------------------------------------------- CPU model


def test_communication_cpu_shares_the_core_with_the_backward_pass():
    """A bucket all-reduced on loopback (no link limit) needs 20 ms of CPU, while the backward
    pass runs: both get half the core until it is done, so the backward ends 20 ms late."""
    from bytescheduler_tools.sim.calibration import BackendCosts, Calibration

    layers = (Layer("a", 0.01, (Tensor(500_000, 0.1),)), Layer("b", 0.01, (Tensor(2_000_000, 0.0),)))
    profile = Profile("two", layers, backward_s=0.1, step_s=0.005)
    loopback = Network(bandwidth=float("inf"), latency=0.0)
    free = simulate(profile, loopback, 2, "ddp")
    assert free.seconds == pytest.approx(0.02 + 0.1 + 0.005)
    costs = Calibration({"gloo": BackendCosts(cpu_per_byte=1e-8)}, memcpy_bytes_per_s=0.0, cores=1)
    busy = simulate(profile, loopback, 2, "ddp", calibration=costs)
    # b's bucket: 20 ms of CPU at half the core -> done 40 ms into backward, which has done 20 ms;
    # the backward's other 80 ms alone; then a's bucket: 5 ms of CPU alone; then the step.
    assert busy.seconds == pytest.approx(0.02 + 0.04 + 0.08 + 0.005 + 0.005)
    assert busy.core_busy == pytest.approx(1.0)


def test_every_scheduled_system_calls_the_runtimes_policy(in_flight_after_decide):
    profile = Profile("two", (Layer("a", 0.01, (Tensor(20 * 2**20, 0.05),)), Layer("b", 0.01, (Tensor(20 * 2**20, 0.0),))),
                      backward_s=0.05, step_s=0.0)
    for system in ("ddp-hook", "scheduled", "hvd-scheduled", "ps-scheduled"):
        in_flight_after_decide.clear()
        simulate(profile, Network(bandwidth=1e9, latency=0.0), 2, system, iterations=4)
        credit = default_config(system).credit_bytes
        assert in_flight_after_decide and max(in_flight_after_decide) <= credit, system


def test_simulate_command_with_a_calibration_draws_a_gantt_per_system(tmp_path, capsys):
    from bytescheduler.cli import main
    from bytescheduler_tools.sim.calibration import BackendCosts, Calibration

    profile = Profile("one", (Layer("x", 0.05, (Tensor(2_000_000, 0.2),)),), backward_s=0.2, step_s=0.01)
    (tmp_path / "profile.json").write_text(profile.to_json())
    costs = BackendCosts(op_seconds=2e-4, cpu_per_op=1e-4, cpu_per_byte=1e-9, idle_cpu_per_s=0.1)
    calibration = Calibration({"gloo": costs, "horovod": costs}, memcpy_bytes_per_s=5e9)
    (tmp_path / "calibration.json").write_text(calibration.to_json())
    assert main(["simulate", "--profile", str(tmp_path / "profile.json"), "--bandwidth", "none", "1gbit",
                 "--systems", "ddp", "hvd", "hvd-scheduled", "--calibration", str(tmp_path / "calibration.json"),
                 "--gantt", str(tmp_path / "gantt.png")]) == 0
    table = capsys.readouterr().out
    assert "| 2 | none | hvd-scheduled |" in table and "CPU model from" in table
    for system in ("ddp", "hvd", "hvd-scheduled"):  # the first rate's iterations
        assert (tmp_path / f"gantt-{system}.png").stat().st_size > 10_000
    with pytest.raises(SystemExit):  # a calibration without the backend a system needs
        main(["simulate", "--profile", str(tmp_path / "profile.json"), "--systems", "ps",
              "--calibration", str(tmp_path / "calibration.json")])


def test_a_gantt_has_a_row_per_thread():
    from bytescheduler_tools.sim.gantt import chart_events

    profile = Profile("two", (Layer("a", 0.01, (Tensor(4 * 2**20, 0.05),)), Layer("b", 0.01, (Tensor(4 * 2**20, 0.0),))),
                      backward_s=0.05, step_s=0.01)
    result = simulate(profile, Network(bandwidth=1e8, latency=0.0), 2, "scheduled", iterations=4, record=True)
    compute, threads = chart_events(list(result.spans))
    assert {e["name"] for e in compute} >= {"forward", "backward"}
    assert {e["cat"] for e in threads} >= {"lane0", "updater"}  # the dispatcher costs nothing uncalibrated
    assert len(result.iteration_starts) == 5
