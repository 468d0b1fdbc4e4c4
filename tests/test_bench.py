"""The benchmark's testbed and runner, for real: namespaces, shaping, reports, teardown."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from bytescheduler_tools.bench.runner import default_mxnet_python
from bytescheduler_tools.bench.testbed import NamespaceTestbed, make_testbed, namespaces_available


def _namespaces():
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_namespaces_are_available_here():
    # CI runs as root with iproute2: the benchmark must not silently fall back to loopback there.
    assert namespaces_available() is None


def test_testbed_builds_a_shaped_star_and_tears_it_down():
    before = _namespaces()
    with NamespaceTestbed(2, "500mbit") as net:
        made = _namespaces() - before
        assert made == {net.hub, *net.names}
        shown = subprocess.run(net.wrap(0, ["tc", "qdisc", "show", "dev", "v0"]), capture_output=True, text=True)
        assert "tbf" in shown.stdout and "500Mbit" in shown.stdout
        reach = subprocess.run(
            net.wrap(1, [sys.executable, "-c",
                         "import socket; s = socket.socket(); s.bind(('10.99.0.2', 0)); print('ok')"]),
            capture_output=True, text=True, timeout=30,
        )
        assert reach.stdout.strip() == "ok", reach.stderr
    assert _namespaces() == before


def test_bad_rate_is_a_clear_error_and_leaves_nothing():
    before = _namespaces()
    with pytest.raises(ValueError, match="1gbit"):
        make_testbed(2, "fast")
    assert _namespaces() == before


def test_bench_on_a_1gbit_testbed_writes_every_report(tmp_path):
    before = _namespaces()
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "bytescheduler.cli", "bench", "--bandwidth", "1gbit", "--model", "tiny",
         "--batch-size", "8", "--systems", "compute", "comm", "ddp", "ddp-hook", "ddp-torch-hook", "ddp-again",
         "ddp-fused", "scheduled",
         "--rounds", "2", "--iters", "1", "--warmup", "1", "--out", str(out), "--deadline", "300"],
        capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _namespaces() == before  # torn down
    assert "| ScheduledOptimizer |" in done.stdout and "vs DDP default" in done.stdout
    summary = json.loads((out / "results.json").read_text())
    assert summary["lead_in"] == 0 and "each from rest to rest" in (out / "results.md").read_text()
    # Which machine: runs on two of ours differed 2x in compute alone.
    assert f"Machine: {summary['machine']}." in (out / "results.md").read_text()
    assert summary["machine"].endswith(f", {os.cpu_count()} CPUs"), summary["machine"]
    assert set(summary["systems"]) == {"compute", "comm", "ddp", "ddp-hook", "ddp-torch-hook", "ddp-again", "ddp-fused",
                                       "scheduled"}
    assert summary["systems"]["ddp-torch-hook"]["baseline"] == "ddp"
    # ours against the fastest of PyTorch's own ways in the run, too
    peers = {name: summary["systems"][name]["median_s"] for name in ("ddp", "ddp-fused", "ddp-torch-hook")}
    scheduled = summary["systems"]["scheduled"]
    assert scheduled["fastest_peer"] == min(peers, key=peers.get)
    assert scheduled["speedup_vs_fastest_peer"] == pytest.approx(min(peers.values()) / scheduled["median_s"])
    assert summary["systems"]["ddp-again"]["baseline"] == "ddp" and "A/A control" in done.stdout
    # The link is shaped: a large all-reduce moves at most ~1 Gbit/s per direction.
    assert summary["link_bytes_per_s"] * 8 < 1.1e9
    assert "namespaces" in summary["network"]
    assert summary["systems"]["scheduled"]["scheduler"]["operations"] > 0
    for name in ("results.md", "speed.png", "timeline-scheduled.png", "timeline-ddp.png"):
        assert (out / name).stat().st_size > 0, name
    if "pinned" in summary["network"]:  # each rank on a CPU of its own: its busy share is measured
        for entry in summary["systems"].values():
            assert all(0.0 <= v <= 1.0 for v in entry["core_busy_per_rank"]), entry
        assert "Core busy:" in (out / "results.md").read_text()


def test_core_busy_counts_a_pinned_process_spinning():
    """The core-busy column's source: a process pinned to one CPU that spins for 0.6 s shows up."""
    script = (
        "import os, time; from bytescheduler_tools.bench.common import cpu_busy_seconds, pinned_cpu\n"
        "cpu = sorted(os.sched_getaffinity(0))[-1]; os.sched_setaffinity(0, {cpu}); assert pinned_cpu() == cpu\n"
        "before = cpu_busy_seconds(cpu); start = time.perf_counter()\n"
        "while time.perf_counter() - start < 0.6: pass\n"
        "print(cpu_busy_seconds(cpu) - before, time.perf_counter() - start)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    busy, elapsed = (float(v) for v in done.stdout.split())
    # Clock ticks are 10 ms; other processes on that CPU can only add to it.
    assert 0.5 <= busy <= elapsed + 0.05, (busy, elapsed)


def test_bench_failure_is_reported_and_cleans_up(tmp_path):
    before = _namespaces()
    done = subprocess.run(
        [sys.executable, "-m", "bytescheduler.cli", "bench", "--bandwidth", "1gbit", "--model", "tiny",
         "--rounds", "1", "--iters", "1", "--warmup", "1", "--partition", "not-a-size", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1
    assert "partition_bytes" in done.stderr and "failed" in done.stderr
    assert _namespaces() == before


def _bench(out, *options, timeout=400):
    """Run ``bytescheduler bench`` on a 1 Gbit/s testbed with a tiny model; return the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "bytescheduler.cli", "bench", "--bandwidth", "1gbit", "--model", "tiny",
         "--batch-size", "8", "--rounds", "2", "--iters", "1", "--warmup", "1", "--out", str(out),
         "--deadline", "240", *options],
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.parametrize("baseline, scheduled, labels, link, control", [
    ("hvd", "hvd-scheduled", ("Horovod DistributedOptimizer", "Horovod + ScheduledOptimizer"), "Horovod all-reduce",
     ["hvd-again"]),
    ("mxnet", "mxnet-scheduled", ("MXNet dist_sync", "MXNet + ScheduledKVStore"), "ps-lite push+pull",
     ["mxnet-again"]),
], ids=["horovod", "mxnet"])
def test_bench_runs_another_framework_in_namespaces(tmp_path, baseline, scheduled, labels, link, control):
    """Horovod ranks without horovodrun; MXNet as a ps-lite job per block, a server and a worker per namespace."""
    before = _namespaces()
    out = tmp_path / "out"
    lead_in = ["--lead-in", "1"] if baseline == "hvd" else []  # refused with MXNet (below)
    done = _bench(out, *lead_in, "--systems", baseline, scheduled, *control)
    assert _namespaces() == before  # torn down
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    assert summary["lead_in"] == len(lead_in) // 2
    assert ("steady state (after 1 untimed iteration;" in (out / "results.md").read_text()) == bool(lead_in)
    assert list(summary["systems"]) == [baseline, scheduled, *control]
    for name in (baseline, scheduled, *control):
        entry = summary["systems"][name]
        assert len(entry["blocks_s"]) == 2 and min(entry["blocks_s"]) > 0, entry
        assert (out / f"timeline-{name}.png").stat().st_size > 0, name
    assert summary["systems"][scheduled]["baseline"] == baseline
    for name in control:  # the A/A control: a second copy of the baseline, timed against it
        assert summary["systems"][name]["baseline"] == baseline and summary["systems"][name]["speedup"] > 0
    assert summary["systems"][scheduled]["speedup"] > 0
    assert summary["systems"][scheduled]["scheduler"]["operations"] > 0
    assert "namespaces" in summary["network"]
    # The link is shaped: a large all-reduce or push+pull moves at most ~1 Gbit/s per direction.
    assert list(summary["links_bytes_per_s"]) == [link]
    assert 0 < summary["link_bytes_per_s"] * 8 < 1.1e9
    assert f"| {labels[1]} |" in done.stdout and f"x vs {labels[0]} |" in done.stdout
    assert (out / "speed.png").stat().st_size > 0
    # The blocks took turns, the order alternating by round (B A in the second), never overlapping:
    # for MXNet, two jobs alive at once.
    spans = sorted((span, name) for name in (baseline, scheduled)
                   for span in summary["systems"][name]["profile_per_rank"][0]["block_spans"])
    assert [name for _, name in spans] == [baseline, scheduled, scheduled, baseline], spans
    assert all(a[0][1] <= b[0][0] for a, b in zip(spans, spans[1:])), spans


class _Idle:
    """What run_blocks asks of a system besides ``iterate`` and ``flush``: no tuning, no mode
    switch, nothing traced or counted (the fakes below add the two)."""

    tuned = False
    trace = choosing = lambda self, *a: False
    modes = mode_verdicts = lambda self: ""
    steady_steps = lambda self: None
    stats = lambda self: {}


def test_blocks_take_turns_with_another_job(tmp_path):
    """Two jobs' run_blocks through one runner's files: each waits for its turn, says when it is done."""
    from types import SimpleNamespace

    from bytescheduler_tools.bench.common import Tracer, Turns, run_blocks

    log: list = []

    class Logged(_Idle):
        def __init__(self, name):
            self.name = name

        def iterate(self):
            log.append(self.name)

        def flush(self):
            pass

    args = SimpleNamespace(warmup=1, auto_tune=0, rounds=2, iters=1, lead_in=0, no_trace=True)
    dirs = {name: tmp_path / name for name in "ab"}
    threads = []
    for name, directory in dirs.items():
        directory.mkdir()
        turns = Turns(str(directory), rank=0, poll_s=0.001)
        threads.append(threading.Thread(target=run_blocks, args=({name: Logged(name)}, args, lambda: None,
                                                                 Tracer(0), 0, turns)))
        threads[-1].start()
    for name in "ab":
        assert (dirs[name] / "ready.rank0").exists()
    for name, turn in [("b", 0), ("a", 0), ("a", 1), ("b", 1), ("b", 2), ("a", 2)]:
        time.sleep(0.05)
        assert not (dirs[name] / f"done-{turn}.rank0").exists()
        (dirs[name] / f"go-{turn}").touch()
        deadline = time.monotonic() + 10
        while not (dirs[name] / f"done-{turn}.rank0").exists():
            assert time.monotonic() < deadline, (name, turn)
            time.sleep(0.001)
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    assert log == ["b", "a", "a", "b", "b", "a"]


def test_a_blocks_lead_in_times_the_steady_state():
    """--lead-in: each block's first iterations are not timed, nor is the flush after the timed
    ones (no flush in between either): the span covers whole periods of a running training."""
    from types import SimpleNamespace

    from bytescheduler_tools.bench.common import Tracer, run_blocks

    calls: list = []

    class Slow(_Idle):
        def iterate(self):
            calls.append("i")
            time.sleep(0.05)

        def flush(self):
            calls.append("f")
            time.sleep(0.3)  # the pending communication of the last iteration: not timed

    args = SimpleNamespace(warmup=1, auto_tune=0, rounds=2, iters=1, lead_in=4, no_trace=True)
    times, *_ = run_blocks({"slow": Slow()}, args, lambda: None, Tracer(0), 0)
    assert "".join(calls) == "if" + "iiiiif" * 2  # warm-up, then lead-in and timed iterations, one flush
    # Each block timed one iteration (50 ms), not the lead-in's four more nor the flush.
    assert all(0.05 <= t < 0.2 for t in times["slow"]), times
    # From rest (no lead-in) the flush is inside the block.
    calls.clear()
    times, *_ = run_blocks({"slow": Slow()}, SimpleNamespace(**{**vars(args), "lead_in": 0}), lambda: None, Tracer(0), 0)
    assert "".join(calls) == "if" + "if" * 2 and all(t >= 0.35 for t in times["slow"]), times


def test_a_lead_in_is_refused_with_mxnet_systems(tmp_path):
    """MXNet's engine queues a block without running it: a span that ends without waiting would
    time the queueing (a 0.005 s 'iteration' of dist_sync on VGG-like, 2026-11-28)."""
    before = _namespaces()
    done = _bench(tmp_path / "out", "--lead-in", "1", "--systems", "ddp", "mxnet", timeout=120)
    assert done.returncode != 0 and "--lead-in cannot time mxnet" in done.stderr, done.stderr[-2000:]
    assert _namespaces() == before and not (tmp_path / "out").exists()


def test_bench_without_mxnet_says_why(tmp_path):
    from argparse import Namespace

    from bytescheduler_tools.bench.runner import HOROVOD_SYSTEMS, MXNET_SYSTEMS, ON_REQUEST, TORCH_SYSTEMS, choose_systems

    # Asked for by name: a clear error before anything runs.
    done = subprocess.run(
        [sys.executable, "-m", "bytescheduler.cli", "bench", "--systems", "mxnet", "--mxnet-python",
         str(tmp_path / "no-python"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0 and "cannot run mxnet" in done.stderr and "no-python" in done.stderr
    # By default: left out, with the reason.
    args = Namespace(quick=False, systems=None, mxnet_python=None, model="tiny", lead_in=0)
    systems, left_out = choose_systems(args)
    assert systems == [name for name in TORCH_SYSTEMS + HOROVOD_SYSTEMS if name not in ON_REQUEST]
    assert "ddp-again" not in systems and "hvd-again" not in systems
    assert set(left_out) == set(MXNET_SYSTEMS) - set(ON_REQUEST) and "--mxnet-python" in left_out["mxnet"]
    # A model without an MXNet version is left out too.
    args = Namespace(quick=False, systems=None, mxnet_python=default_mxnet_python(), model="gpt2", lead_in=0)
    assert "no MXNet version" in choose_systems(args)[1]["mxnet-scheduled"]
    # --lead-in cannot time MXNet (test_a_lead_in_is_refused_with_mxnet_systems): left out too.
    args = Namespace(quick=False, systems=None, mxnet_python=default_mxnet_python(), model="tiny", lead_in=1)
    systems, left_out = choose_systems(args)
    assert systems == [name for name in TORCH_SYSTEMS + HOROVOD_SYSTEMS if name not in ON_REQUEST]
    assert set(left_out) == set(MXNET_SYSTEMS) - set(ON_REQUEST)
    assert all("engine" in why and "--lead-in" in why for why in left_out.values())


def test_mxnet_models_have_the_torch_models_shapes():
    from bytescheduler_tools.bench.models import build

    script = ("import json; from bytescheduler_tools.bench.mxnet_models import MODELS, shapes; "
              "print(json.dumps({name: shapes(name) for name in MODELS}))")
    done = subprocess.run([default_mxnet_python(), "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert set(found) >= {"vgg", "vgg-small", "tiny"}
    for name, shapes in found.items():
        model, _ = build(name)
        assert [list(p.shape) for p in model.parameters()] == shapes, name


def _ranks(times, links, gradient_bytes, profile=None):
    return [{"rank": rank, "times": times, "rss_mib": {name: 1.0 for name in times}, "core_busy": {},
             "peak_rss_mib": 1.0, "links": links, "gradient_bytes": gradient_bytes, "stats": {},
             "compute_events": [], "profile": profile or {}} for rank in (0, 1)]


def test_attainable_gain_uses_each_frameworks_own_link():
    from bytescheduler_tools.bench.report import markdown, summarize

    # 2 ranks send 1x the gradient bytes: 1 s at gloo's rate, 2 s at Horovod's.
    times = {"compute": [0.5], "ddp": [3.0], "scheduled": [2.0], "hvd": [3.0], "hvd-scheduled": [2.5],
             "ddp-hook": [3.2]}
    links = {"gloo all-reduce": 1e9, "Horovod all-reduce": 0.5e9}
    summary = summarize(_ranks(times, links, int(1e9)), batch_size=8)
    systems = summary["systems"]
    assert systems["scheduled"]["attainable_gain"] == pytest.approx((3.0 - 2.0) / (3.0 - 1.0))
    assert systems["hvd-scheduled"]["attainable_gain"] == pytest.approx((3.0 - 2.5) / (3.0 - 2.0))
    assert systems["ddp-hook"]["attainable_gain"] == pytest.approx(-0.1)  # slower than DDP
    assert "attainable_gain" not in systems["ddp"]
    table = markdown(summary, "header")
    assert "| 50% |" in table and "| -10% |" in table


def test_attainable_gain_when_the_baseline_is_at_the_floor():
    from bytescheduler_tools.bench.report import markdown, summarize

    times = {"compute": [1.0], "ddp": [1.005], "scheduled": [1.0]}
    summary = summarize(_ranks(times, {"gloo all-reduce": 1e9}, int(1e8)), batch_size=8)
    assert summary["systems"]["scheduled"]["attainable_gain"] is None
    assert "nothing to win" in markdown(summary, "header")


def test_the_timeline_shows_a_block_that_kept_one_mode():
    from bytescheduler_tools.bench.common import trace_block
    from bytescheduler.core.modes import SCHEDULED, ModeChooser, ModeSwitchParams

    # VGG-like at 1 Gbit/s (2026-11-28): the schedule chosen 12% ahead, a second look after 50
    # steps, which fell in the last of 6 blocks of 10: its timeline was the framework's path.
    chooser = ModeChooser(ModeSwitchParams(warmup=3, settle=1, trial=4, verify_hold=50))

    def step():
        chooser.record(1.07 if chooser.mode == SCHEDULED else 1.22)
        if chooser.end_step():
            chooser.adopt(chooser.propose())

    while chooser.choices == 0:  # the bench's warm-up runs the first trials
        step()
    blocks, traced = [], False  # the modes of each traced block, blocks run as run_blocks does
    for round_index in range(6):
        trace = trace_block(round_index, 6, 10, chooser.steady_steps, traced)
        traced = traced or trace
        start = len(chooser.history)
        for _ in range(10):
            step()
        if trace:
            blocks.append("".join(mode[0] for mode in chooser.history[start:]))
    assert blocks[-1] == "s" * 10, blocks  # the last block that kept the chosen schedule
    assert len(blocks) == 1  # the last block, with the re-trial, is not traced
    # Without a switch, or a hold past the last block: the last block alone, as before.
    assert [trace_block(r, 6, 10, None, False) for r in range(6)] == [False] * 5 + [True]
    assert [trace_block(r, 6, 10, 200 - 10 * r, False) for r in range(6)] == [False] * 5 + [True]
    # No block kept one mode (trials all along): the last is traced anyway.
    assert trace_block(5, 6, 10, 0, False) is True


def test_cpu_meter_counts_each_thread_by_role():
    import threading
    import time

    from bytescheduler_tools.bench.common import CpuMeter

    done = threading.Event()

    def spin():
        while not done.is_set():
            pass

    meter = CpuMeter(None)
    meter.start()
    until = time.monotonic() + 0.3
    worker = threading.Thread(target=spin, name="bytescheduler-spin")
    other = threading.Thread(target=spin, name="someone-else")
    worker.start()
    other.start()
    while time.monotonic() < until:
        pass
    meter.stop("system", iterations=2)  # before the threads end: ended threads are not counted
    done.set()
    worker.join()
    other.join()
    ms = meter.per_iteration_ms()["system"]
    assert ms["training thread"] > 5 and ms["bytescheduler threads"] > 5 and ms["other Python threads"] > 5, ms
    # Three threads spinning for 0.3 s can have run at most 0.9 s (plus a little slack), over 2 iterations.
    assert sum(ms.values()) < 500, ms
    assert meter.per_iteration_ms(by_thread=True)["system"]["bytescheduler-spin"] == ms["bytescheduler threads"]


def test_report_shows_where_the_cpu_goes():
    from bytescheduler_tools.bench.report import markdown, summarize

    profile = {"scheduled": {"cpu_ms_per_iteration": {"training thread": 400.0, "bytescheduler threads": 12.0,
                                                      "native threads": 30.0, "other Python threads": 0.0,
                                                      "rest of the core": 5.0},
                             "bytescheduler_thread_ms_per_iteration": {"bytescheduler-update": 7.5,
                                                                       "bytescheduler-dispatch": 4.5},
                             "operations_per_iteration": 40.0, "pieces_per_iteration": 90.0}}
    summary = summarize(_ranks({"ddp": [1.0], "scheduled": [0.9]}, {"gloo all-reduce": 1e9}, int(1e8), profile),
                        batch_size=8)
    table = markdown(summary, "header")
    assert "| ScheduledOptimizer | 900 | 400/400 | 12/12 | 30/30 | 0/0 | 5/5 | 40 / 90 |" in table, table
    assert "| DDP default |" in table.split("CPU per iteration")[0]  # DDP has no profile: no CPU row
    assert "ScheduledOptimizer: bytescheduler-dispatch 4.5, bytescheduler-update 7.5." in table, table


def test_the_demo_says_how_to_see_the_win_where_no_link_can_be_shaped(capsys, tmp_path):
    from bytescheduler_tools.bench.runner import QUICK_SHAPED, quick_shaped

    assert quick_shaped(str(tmp_path), False, "not root") == 0
    said = capsys.readouterr().out
    assert "No shaped link here (not root)" in said and "--cap-add NET_ADMIN" in said
    assert "bytescheduler bench " + " ".join(QUICK_SHAPED) in said
    assert not os.listdir(tmp_path)  # nothing ran


def test_the_demo_finds_a_shaped_link_here_and_runs_its_first_part_on_it(monkeypatch, capsys, tmp_path):
    from bytescheduler_tools.bench import runner

    # Root with iproute2 (as CI): the probe really makes a shaped testbed, and leaves nothing.
    before = _namespaces()
    assert runner.shaping_problem() is None
    assert _namespaces() == before
    ran = []
    monkeypatch.setattr(runner, "main", lambda argv: ran.append(argv) or 0)
    assert runner.quick_shaped(str(tmp_path), True, None) == 0
    assert ran == [[*runner.QUICK_SHAPED, "--out", str(tmp_path / "1gbit"), "--no-pin"]]
    said = capsys.readouterr().out
    assert said.index("Part 1 of 2: a 1 Gbit/s link") < said.index("Part 2 of 2: loopback")


def _fused_against_ddp(rank, world_size):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bytescheduler_tools.bench.worker import FusedStep

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))

    plain, fused = DDP(model()), DDP(model())
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    fused._register_fused_optim(torch.optim.SGD, lr=0.01, momentum=0.9)
    step = FusedStep(fused)
    for index in range(5):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * rank + index))
        for net, opt in ((plain, optimizer), (fused, step)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    return max((a - b).abs().max().item() for a, b in zip(plain.parameters(), fused.parameters()))


def test_the_ddp_fused_peer_trains_as_ddp_with_its_optimizer():
    """The bench's ddp-fused (DDP updating each bucket right after its all-reduce) trains the
    model DDP and SGD train, on 2 gloo ranks: a fair peer."""
    from tests.distributed import run_ranks

    for difference in run_ranks(_fused_against_ddp, 2, deadline=120):
        assert difference < 1e-6, difference
