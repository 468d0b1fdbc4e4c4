"""``bytescheduler sweep``: every prediction of a grid of clusters and settings, the best of each, a plot."""

import json
import math

import pytest

from bytescheduler_tools.sim.engine import simulate
from bytescheduler_tools.sim.network import Network
from bytescheduler_tools.sim.profile import Layer, Profile, Tensor
from bytescheduler_tools.sim.sweep import Sweep, best_per_cluster, effective_rate, parse_ranks

MiB = 1024**2


def _two_layers():
    return Profile("two", (Layer("a", 0.01, (Tensor(1_000, 0.095),)), Layer("b", 0.01, (Tensor(300_000, 0.0),))),
                   backward_s=0.1, step_s=0.0)


def test_ranks_take_numbers_and_power_of_two_ranges():
    assert parse_ranks(["2-1024"]) == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert parse_ranks(["3", "8-16", "16"]) == [3, 8, 16]
    for bad in ("many", "16-2", "0"):
        with pytest.raises(ValueError, match="--ranks"):
            parse_ranks([bad])


def test_every_setting_against_the_framework_once_per_cluster():
    sweep = Sweep(_two_layers(), latency=0.0)
    rows = sweep.run([2, 4], ["8mbit", "16mbit"], [10_000, 400_000], [10_000])
    assert len(rows) == 2 * 2 * 2
    for row in rows:
        network = Network(float(row.bandwidth[:-4]) * 1e6 / 8, latency=0.0)
        assert row.framework_seconds == pytest.approx(simulate(_two_layers(), network, row.ranks, "ddp").seconds)
        assert row.speedup == pytest.approx(row.framework_seconds / row.seconds)
    best = best_per_cluster(rows)
    assert sorted(best) == [(2, "16mbit"), (2, "8mbit"), (4, "16mbit"), (4, "8mbit")]
    # 2 ranks at 1 MB/s: cutting b lets a overtake it (tests/test_plan.py works it out by hand).
    assert best[(2, "8mbit")].partition_bytes == 10_000


def test_the_rate_at_which_the_framework_is_as_slow_as_a_reported_baseline():
    sweep = Sweep(_two_layers(), latency=0.0)
    rate = effective_rate(sweep, 2, 0.416)  # the framework's time at 1 MB/s, worked out in test_plan.py
    assert rate == pytest.approx(1e6, rel=1e-3)
    assert math.isnan(effective_rate(sweep, 2, 0.01))  # faster than its compute: no rate is that fast


def test_sweep_command_writes_every_prediction_and_a_plot(tmp_path, capsys):
    from bytescheduler.cli import main

    profile = tmp_path / "two.json"
    profile.write_text(_two_layers().to_json())
    out, plot = tmp_path / "sweep.json", tmp_path / "speedup.png"
    assert main(["sweep", "--profile", str(profile), "--ranks", "2-8", "--bandwidth", "8mbit", "80mbit",
                 "--partition", "10000", "400000", "--credit", "10000", "20000", "--latency-us", "0",
                 "--json", str(out), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert "| 8 | 80mbit |" in table and "best setting" in table
    data = json.loads(out.read_text())
    assert len(data["predictions"]) == 3 * 2 * 2 * 2 and data["framework_path"] == "ddp"
    assert {(p["ranks"], p["bandwidth"], p["partition_bytes"], p["credit_bytes"]) for p in data["predictions"]} == \
        {(r, b, p, c) for r in (2, 4, 8) for b in ("8mbit", "80mbit") for p in (10_000, 400_000) for c in (10_000, 20_000)}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_paper_comparison_needs_a_paper_model_and_adds_its_columns(tmp_path, capsys):
    from bytescheduler.cli import main

    profile = tmp_path / "two.json"
    profile.write_text(_two_layers().to_json())
    with pytest.raises(SystemExit):
        main(["sweep", "--profile", str(profile), "--compare-paper"])
    assert "--compare-paper needs one of the paper's models" in capsys.readouterr().err
    out = tmp_path / "paper.json"
    assert main(["sweep", "--model", "resnet50-v100", "--ranks", "16", "--bandwidth", "100gbit",
                 "--partition", "16MiB", "--credit", "64MiB", "--compare-paper", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "paper's speedup" in table and "| 16 | 100gbit |" in table and "1.16x" in table
    paper = json.loads(out.read_text())["paper"]
    assert set(paper) == {"8", "16", "32", "64"}
    assert paper["16"]["reported_speedup"] == pytest.approx(2934 / 2535)


def test_the_parameter_servers_default_partition_follows_the_servers_in_every_cluster():
    # No --partition: each cluster gets the adapter's own default, which for ScheduledKVStore
    # depends on the number of servers (one per rank, or --servers) and, on 1-2 servers, on
    # the link, as its probe at the first init chooses (whole keys on a fast one).
    from bytescheduler.core.grain import server_grain_bytes

    profile = Profile("big", (Layer("a", 0.01, (Tensor(3 * MiB, 0.1),)),), backward_s=0.1, step_s=0.0)
    rows = Sweep(profile, "ps-scheduled", latency=0.0).run([2, 32], ["1gbit", "10gbit"])
    assert [(row.ranks, row.bandwidth, row.partition_bytes, row.credit_bytes) for row in rows] == [
        (2, "1gbit", 4 * MiB, 64 * MiB), (2, "10gbit", 64 * MiB, 64 * MiB),
        (32, "1gbit", 256 * 1024, 64 * MiB), (32, "10gbit", 256 * 1024, 64 * MiB)]
    assert server_grain_bytes(32) == 256 * 1024
    fixed = Sweep(profile, "ps-scheduled", latency=0.0, servers=8)
    assert fixed.network(1e9).servers == 8
    assert fixed.settings(32, [None, MiB], [None]) == [(MiB, 64 * MiB), (MiB, 64 * MiB)]
    # the all-reduce systems do not depend on servers
    assert Sweep(profile, "scheduled").settings(2, [None], [None]) == Sweep(profile, "scheduled").settings(
        64, [None], [None])
