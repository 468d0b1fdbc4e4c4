"""``bytescheduler tuner-check`` on a tiny configuration (loopback, a small model, few steps): for
correctness only; the real measurement (VGG at 1 Gbit/s on the shaped testbed) needs a quiet machine."""

import json

from bytescheduler_tools.bench.tuner_check import grid_settings, verdict
from bytescheduler.core.plan import Plan

KiB = 1024


def test_the_grid_holds_every_partition_and_credit_and_the_plans_setting():
    assert grid_settings((16 * KiB, 16 * KiB), [16 * KiB, 32 * KiB], [1, 4]) == [
        (16 * KiB, 16 * KiB), (16 * KiB, 64 * KiB), (32 * KiB, 32 * KiB), (32 * KiB, 128 * KiB)]
    assert grid_settings((8 * KiB, 24 * KiB), [8 * KiB], [2]) == [(8 * KiB, 16 * KiB), (8 * KiB, 24 * KiB)]


def test_the_verdict_is_the_first_step_whose_best_so_far_is_close_enough():
    grid = {(1, 1): 1.00, (2, 2): 0.90, (4, 4): 0.86}
    steps = [{"best_so_far": None}, {"best_so_far": [1, 1]}, {"best_so_far": [2, 2]}, {"best_so_far": [4, 4]}]
    assert verdict(grid, steps, 0.05)["reached_at_step"] == 3  # 0.90 is within 5% of 0.86
    assert verdict(grid, steps, 0.01)["reached_at_step"] == 4
    assert verdict(grid, steps[:2], 0.05)["reached_at_step"] is None
    assert verdict(grid, [{"best_so_far": [8, 8]}], 0.5)["reached_at_step"] is None  # outside the grid: unknown


def test_a_tiny_run_measures_the_grid_then_the_tuner_from_the_plan(tmp_path, capsys):
    from bytescheduler.cli import main

    plan = tmp_path / "plan.json"
    plan.write_text(Plan(True, 32 * KiB, 64 * KiB).to_json())
    out = tmp_path / "check.json"
    code = main(["tuner-check", "--model", "tiny", "--bandwidth", "none", "--plan", str(plan),
                 "--partitions", "16KiB", "64KiB", "--credit-multiples", "1", "2",
                 "--warmup", "1", "--settle", "1", "--iters", "2", "--rounds", "2",
                 "--tuner-steps", "12", "--deadline", "240", "--json", str(out)])
    assert code == 0
    report = capsys.readouterr().out
    assert "(the plan's)" in report and "tuner trial" in report
    data = json.loads(out.read_text())
    settings = {(p, c) for p, c, _ in data["grid"]}
    assert settings == {(16 * KiB, 16 * KiB), (16 * KiB, 32 * KiB), (64 * KiB, 64 * KiB), (64 * KiB, 128 * KiB),
                        (32 * KiB, 64 * KiB)}  # the grid and the plan's setting
    assert all(seconds > 0 for _, _, seconds in data["grid"])
    assert all(len(blocks) == 2 for blocks in data["grid_blocks"].values())  # one block per round
    steps = data["tuner"]["steps"]
    assert len(steps) == 12 and all(step["seconds"] > 0 for step in steps)
    assert steps[0]["setting"] == [32 * KiB, 64 * KiB]  # the tuner starts at the plan's setting
    assert data["tuner"]["trials"][0][:2] == [32 * KiB, 64 * KiB]
    assert data["verdict"]["grid_fastest"] in [list(s) for s in settings]
