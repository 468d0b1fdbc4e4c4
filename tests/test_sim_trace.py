"""A recorded run is enough to simulate it: ScheduledOptimizer's timeline -> a profile -> a prediction."""

import json

import pytest

from bytescheduler_tools.sim.engine import simulate
from bytescheduler_tools.sim.network import Network
from bytescheduler_tools.sim.trace import TraceError, profile_from_trace
from tests.distributed import run_ranks


def _train_with_timeline(rank, world_size, path):
    import torch
    import torch.nn.functional as F

    import bytescheduler.pytorch as bsp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01), timeline=path,
                                       adaptive=False)
    inputs, targets = torch.randn(64, 64), torch.randint(0, 10, (64,))
    for _ in range(12):
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    optimizer.synchronize()
    optimizer.close()
    return [p.numel() * p.element_size() for p in model.parameters()]


def test_a_recorded_run_becomes_a_profile_and_a_prediction(tmp_path, capsys):
    sizes = run_ranks(_train_with_timeline, 2, args=(str(tmp_path / "trace.json"),), deadline=180)[0]
    profile = profile_from_trace([str(tmp_path / "trace.rank0.json")])
    assert [layer.name for layer in profile.layers] == ["0", "2", "4"]
    assert [t.nbytes for layer in profile.layers for t in layer.tensors] == sizes
    assert all(layer.forward_s > 0 for layer in profile.layers)
    assert profile.backward_s > 0 and profile.step_s > 0  # the updater's spans
    ready = [max(t.ready_s for t in layer.tensors) for layer in profile.layers]
    # Backward produces the last layer's gradients first.
    assert ready[2] <= ready[1] <= ready[0] <= profile.backward_s * 1.05
    result = simulate(profile, Network(bandwidth=1e9, latency=0.0), 2, "scheduled")
    assert result.seconds >= profile.forward_s + profile.backward_s
    rank1 = profile_from_trace([str(tmp_path / "trace.rank1.json")])
    assert [t.nbytes for layer in rank1.layers for t in layer.tensors] == sizes
    from bytescheduler.cli import main

    assert main(["simulate", "--trace", str(tmp_path / "trace.rank0.json"), "--ranks", "8", "--bandwidth", "10gbit",
                 "--systems", "ddp", "scheduled", "--save-profile", str(tmp_path / "profile.json")]) == 0
    assert "| 8 | 10gbit | scheduled |" in capsys.readouterr().out
    assert (tmp_path / "profile.json").read_text() == profile.to_json().replace('"trace"', '"trace.rank0.json"')


def test_a_trace_without_compute_spans_says_what_to_record(tmp_path):
    path = tmp_path / "hook.json"
    path.write_text(json.dumps([
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}},
        {"name": "bucket0", "cat": "task", "ph": "b", "id": 1, "pid": 0, "tid": 0, "ts": 10.0,
         "args": {"key": 0, "bytes": 400}},
        {"name": "bucket0", "cat": "task", "ph": "e", "id": 1, "pid": 0, "tid": 0, "ts": 20.0},
    ]))
    with pytest.raises(TraceError, match="ScheduledOptimizer and a timeline"):
        profile_from_trace([str(path)])
    with pytest.raises(TraceError, match="cannot read"):
        profile_from_trace([str(tmp_path / "missing.json")])
