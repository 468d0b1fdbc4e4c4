"""Timeline: one valid Chrome trace (JSON array) per rank, with balanced async spans."""

from __future__ import annotations

import json
import threading
from collections import defaultdict

import pytest

from bytescheduler.core import Scheduler, Timeline
from bytescheduler.core.ordering import LocalOrderHub
from bytescheduler.core.timeline import timeline_path
from tests.fakes import WAIT, FakeBackend, make_task


def load(path):
    with open(path, encoding="utf-8") as handle:
        events = json.load(handle)
    assert isinstance(events, list)
    return events


def spans(events, rank):
    """Check every async event and return {category: [(name, begin, end, args)]}."""
    by_id = defaultdict(list)
    for event in events:
        if event["ph"] in ("b", "e"):
            assert event["pid"] == rank
            by_id[event["id"]].append(event)
        else:
            assert event["ph"] == "M"
    found = defaultdict(list)
    for span_id, pair in by_id.items():
        phases = sorted(e["ph"] for e in pair)
        assert phases == ["b", "e"], f"span {span_id} is not one begin and one end: {pair}"
        begin = next(e for e in pair if e["ph"] == "b")
        end = next(e for e in pair if e["ph"] == "e")
        assert begin["cat"] == end["cat"] and begin["name"] == end["name"]
        assert end["ts"] >= begin["ts"], pair
        found[begin["cat"]].append((begin["name"], begin["ts"], end["ts"], begin.get("args", {})))
    return found


def check_metadata(events, rank):
    names = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(names) == 1
    assert names[0]["pid"] == rank and names[0]["args"]["name"] == f"rank {rank}"


def test_timeline_path():
    assert timeline_path("/tmp/trace.json", 1) == "/tmp/trace.rank1.json"
    assert timeline_path("/tmp/trace", 0) == "/tmp/trace.rank0.json"
    assert timeline_path("/tmp/t-{rank}.json", 3) == "/tmp/t-3.json"
    assert timeline_path("out/{rank}/trace.json", 2) == "out/2/trace.json"


def test_single_rank_timeline(tmp_path):
    configured = str(tmp_path / "trace.json")
    backend = FakeBackend("pool", num_lanes=2, delay=(0, 0.001), seed=5)
    sizes = [10, 40, 300, 0, 90, 1000, 5, 5, 5]
    with Scheduler(backend, timeline=configured, partition_bytes=100, credit_bytes=300,
                   fast_lane_bytes=50, merge=True) as s:
        futures = [s.submit(make_task(k, n, priority=k % 3, fuse_key="a" if k % 2 else None))
                   for k, n in enumerate(sizes)]
        for future in futures:
            future.result(timeout=WAIT)
        stats = s.stats
    backend.close()

    path = tmp_path / "trace.rank0.json"
    assert path.exists() and not (tmp_path / "trace.json").exists()
    events = load(path)
    check_metadata(events, 0)
    found = spans(events, 0)
    assert set(found) == {"task", "queue", "lane0", "lane1"}
    # One task span per non-empty task, one queue span per piece, one lane span per operation.
    assert sorted(args["key"] for _, _, _, args in found["task"]) == [k for k, n in enumerate(sizes) if n]
    assert len(found["queue"]) == stats["pieces"] == sum(len(r.pieces) for r in backend.ops)
    assert len(found["lane0"]) + len(found["lane1"]) == stats["operations"] == len(backend.ops)
    assert sorted(a["bytes"] for _, _, _, a in found["lane0"] + found["lane1"]) == sorted(r.nbytes for r in backend.ops)
    # The fast lane carries small operations, and a single urgent piece when it is idle
    # (see Scheduler._window): never a fused operation above its size.
    assert all(a["bytes"] <= 50 or a["pieces"] == 1 for _, _, _, a in found["lane1"])
    assert all(a["bytes"] > 50 for _, _, _, a in found["lane0"])
    for name, begin, end, args in found["task"]:
        assert args["bytes"] == sizes[args["key"]] and args["generation"] == 0 and name == f"key{args['key']}"


def test_timeline_per_rank_with_order_hub(tmp_path):
    world = 3
    configured = str(tmp_path / "run" / "trace-{rank}.json")  # the directory does not exist yet
    hub = LocalOrderHub(world, timeout=10)
    backends = [FakeBackend("pool", num_lanes=2, delay=(0, 0.001), seed=r) for r in range(world)]
    schedulers = [Scheduler(backends[r], channel=hub.channel(r), rank=r, timeline=configured, timeout=10,
                            partition_bytes=64, fast_lane_bytes=16) for r in range(world)]
    errors = []

    def rank_main(rank):
        try:
            s = schedulers[rank]
            for _ in range(3):
                futures = [s.submit(make_task(k, n, fuse_key="a")) for k, n in enumerate([8, 200, 16, 70])]
                for future in futures:
                    future.result(timeout=WAIT)
            s.stop()
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for b in backends:
        b.close()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)

    for rank in range(world):
        events = load(tmp_path / "run" / f"trace-{rank}.json")
        check_metadata(events, rank)
        found = spans(events, rank)
        assert set(found) == {"task", "queue", "lane0", "lane1"}
        assert len(found["task"]) == 12
        generations = sorted((a["key"], a["generation"]) for _, _, _, a in found["task"])
        assert generations == sorted((k, g) for k in range(4) for g in range(3))
        assert len(found["lane0"]) + len(found["lane1"]) == len(backends[rank].ops)


def test_large_timeline_flushes_in_chunks_and_stays_valid(tmp_path):
    configured = str(tmp_path / "big.json")
    backend = FakeBackend("immediate")
    with Scheduler(backend, timeline=configured, merge=False, partition_bytes=64) as s:
        futures = [s.submit(make_task(k % 50, 10)) for k in range(1000)]  # 6000 events > one flush
        for future in futures:
            future.result(timeout=WAIT)
    events = load(tmp_path / "big.rank0.json")
    check_metadata(events, 0)
    found = spans(events, 0)
    assert len(found["task"]) == len(found["queue"]) == len(found["lane0"]) == 1000
    assert len(events) == 1 + 6 * 1000


def test_empty_run_writes_valid_timeline(tmp_path):
    with Scheduler(FakeBackend("immediate"), timeline=str(tmp_path / "empty.json")):
        pass
    events = load(tmp_path / "empty.rank0.json")
    assert [e["ph"] for e in events] == ["M"]


def test_timeline_stop_without_wait_still_closes_the_file(tmp_path):
    backend = FakeBackend("manual")
    s = Scheduler(backend, timeline=str(tmp_path / "t.json"), timeout=30)
    s.submit(make_task(0, 10))
    backend.wait_launched(1)
    s.stop(wait=False)
    backend.release_all()  # completes after the timeline closed: must not corrupt it
    check_metadata(load(tmp_path / "t.rank0.json"), 0)


def test_timeline_object_close_twice_and_span_after_close(tmp_path):
    timeline = Timeline(str(tmp_path / "x.json"), 4)
    timeline.span("task", "a", 1.0, 2.0, {"key": 1})
    timeline.close()
    timeline.close()
    timeline.span("task", "b", 2.0, 3.0)
    events = load(tmp_path / "x.rank4.json")
    check_metadata(events, 4)
    found = spans(events, 4)
    assert [name for name, *_ in found["task"]] == ["a"]
    (_, begin, end, args), = found["task"]
    assert end - begin == pytest.approx(1e6) and args == {"key": 1}
