"""One MXNet worker of a benchmark job: gluon training on a ps-lite parameter server (``dist_sync``).

Run by :mod:`bytescheduler_tools.bench.runner` with the MXNet interpreter, never by hand. Systems:

- ``mxnet``: ``gluon.Trainer(..., kvstore=mx.kv.create("dist_sync"), update_on_kvstore=True)``
  (SGD with momentum on the servers);
- ``mxnet-scheduled``: the same with ``ScheduledKVStore("dist_sync")`` and ``kv.overlap(net)``.

One system per process: in MXNet 1.9.1 a second ``dist_sync`` store in one process never
returns from ``mx.kv.create`` (ps-lite's start barrier), so the runner starts a job per
system and the jobs take turns (``--turns``, :class:`~bytescheduler_tools.bench.common.Turns`):
both stay alive for the whole run, each idle while the other's block runs, so each system
warms up (and its mode switch chooses) once, as in a user's training run.

MXNet's engine runs operators asynchronously, so the compute spans cannot be read off the
Python calls: during the traced block MXNet's profiler records when each operator ran, and
runs of forward operators and of backward ones (``ImperativeBulk`` segments) without a
pause between them become forward and backward spans; a gap is the engine waiting (e.g. a
forward for a layer's pulled weights). The updates run on the servers.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import List, Tuple

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from bytescheduler.launcher import run_worker
from .common import (LINK_MEGABYTES, System, Tracer, Turns, add_arguments, link_rate, record_timeline, run_blocks,
                     write_result)
from .mxnet_models import build

SYSTEMS = ("mxnet", "mxnet-scheduled", "mxnet-again")  # mxnet-again: an A/A control, a second mxnet
LINK_KEY = 99_999  # below ScheduledKVStore's sub-keys, above any parameter index
# Operators that are neither forward nor backward computation: copies into and out of the
# kvstore's buffers, variable deletion, setting the head gradient.
_BOOKKEEPING = ("DeleteVariable", "CopyCPU2CPU", "SetValueOp")


class ProfilingTracer(Tracer):
    """A :class:`Tracer` whose ``active`` switch runs MXNet's profiler (see the module docstring)."""

    def __init__(self, rank: int, path: str) -> None:
        self._running = False
        super().__init__(rank)
        self.path = path
        mx.profiler.set_config(profile_imperative=True, aggregate_stats=False, filename=path)

    @property
    def active(self) -> bool:
        return self._running

    @active.setter
    def active(self, value: bool) -> None:
        if value != self._running:
            mx.profiler.set_state("run" if value else "stop")
            self._running = value

    def collect(self, system: str) -> None:
        """Turn what the profiler recorded into forward and backward spans of ``system``."""
        self.active = False
        mx.profiler.dump()
        with open(self.path) as handle:
            events = json.load(handle)["traceEvents"]
        for name, start, end in _runs(_operators(events)):
            self.record_wall(system, name, start, end)


def _operators(events: List[dict]) -> List[Tuple[str, float, float]]:
    """(kind, start, end) of every computing operator on the CPU device (pid 0), in time order."""
    found, open_ = [], {}
    for event in events:
        if event.get("cat") != "operator" or event.get("pid") != 0 or event["name"] in _BOOKKEEPING:
            continue
        key = (event["tid"], event["name"])
        if event["ph"] == "B":
            open_.setdefault(key, []).append(event["ts"])
        elif event["ph"] == "E" and open_.get(key):
            backward = event["name"] == "ImperativeBulk" or event["name"].startswith("_backward")
            found.append(("backward" if backward else "forward", open_[key].pop(), event["ts"]))
    return sorted(found, key=lambda op: op[1])


def _runs(operators: List[Tuple[str, float, float]], gap_us: float = 1000.0) -> List[Tuple[str, float, float]]:
    """Consecutive operators of one kind merged into one span, unless the engine waited between them."""
    runs: List[Tuple[str, float, float]] = []
    for kind, start, end in operators:
        if runs and runs[-1][0] == kind and start - runs[-1][2] <= gap_us:
            runs[-1] = (kind, runs[-1][1], max(runs[-1][2], end))
        else:
            runs.append((kind, start, end))
    return runs


class GluonSystem(System):
    """A gluon model trained through a kvstore with server-side updates."""

    def __init__(self, name: str, kv, args: argparse.Namespace, rank: int) -> None:
        self.name, self.kv = name, kv
        mx.random.seed(0)
        self.net, make_batch = build(args.model)
        self.net.initialize(mx.init.Xavier())
        self.params = list(self.net.collect_params().values())
        self.trainer = gluon.Trainer(self.net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                     kvstore=kv, update_on_kvstore=True)
        self.loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        self.batch_size = args.batch_size
        self.inputs, self.labels = make_batch(args.batch_size, rank)

    def iterate(self) -> None:
        with autograd.record():
            loss = self.loss_fn(self.net(self.inputs), self.labels)
        loss.backward()
        self.trainer.step(self.batch_size)

    def flush(self) -> None:
        mx.nd.waitall()


class ScheduledGluonSystem(GluonSystem):
    """The same through a ScheduledKVStore, each block's forward waiting only for its own pulls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv.overlap(self.net)
        self.tuned = self.kv.scheduler.config.auto_tune

    def flush(self) -> None:
        self.kv.synchronize()
        mx.nd.waitall()

    def stats(self) -> dict:
        # The server grain rank 0 chose at the first init, and its probe of the link (bytes/s).
        return dict(self.kv.scheduler.stats, grain_bytes=self.kv.grain_bytes, store_link_rate=self.kv.link_rate)

    def mode_switch(self):
        return self.kv.driver

    def trace(self, active: bool) -> None:
        record_timeline(self.kv.scheduler, active)

    def close(self) -> None:
        self.kv.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--link-only", action="store_true",
                        help="measure the link and nothing else (its memory would count in the system's RSS)")
    parser.add_argument("--turns", default=None, metavar="DIR",
                        help="take turns with other jobs through files in DIR (see common.Turns)")
    args = parser.parse_args(argv)
    if len(args.systems) != 1 or args.systems[0] not in SYSTEMS:
        parser.error(f"--systems takes one of {', '.join(SYSTEMS)} (one dist store per process)")
    name = args.systems[0]
    if name == "mxnet-scheduled":
        from bytescheduler.mxnet.kvstore import ScheduledKVStore

        if args.trace_dir and not args.no_trace:
            os.environ["BYTESCHEDULER_TIMELINE"] = os.path.join(args.trace_dir, f"{name}.json")
        else:
            os.environ.pop("BYTESCHEDULER_TIMELINE", None)
        kv = ScheduledKVStore("dist_sync", partition_bytes=args.partition, credit_bytes=args.credit,
                              auto_tune=bool(args.auto_tune))
    else:
        kv = mx.kv.create("dist_sync")
    rank = kv.rank
    tracer = ProfilingTracer(rank, os.path.join(os.path.dirname(args.output), f"profile.rank{rank}.json"))
    system_class = ScheduledGluonSystem if name == "mxnet-scheduled" else GluonSystem
    system = system_class(name, kv, args, rank)
    link = 0.0
    if not args.no_link:
        array = mx.nd.zeros((LINK_MEGABYTES * 2**20 // 4,))
        # Through the unwrapped store, before training: the probe is no training step (a
        # ScheduledKVStore's mode switch would count each of its pushes as one).
        store = getattr(kv, "inner", kv)
        store.init(LINK_KEY, array)

        def pushpull() -> None:
            store.pushpull(LINK_KEY, array, out=array)
            mx.nd.waitall()
        link = link_rate(pushpull, kv._barrier, kv.num_workers)
    gradient_bytes = sum(p.data().size * np.dtype(p.dtype).itemsize for p in system.params)
    systems = {} if args.link_only else {name: system}
    times, rss, busy, profile = (run_blocks(systems, args, kv._barrier, tracer, rank, Turns(args.turns, rank))
                                 if systems else ({}, {}, {}, {}))
    if systems and not args.no_trace:
        tracer.collect(name)
    write_result(args, rank, systems, times, rss, busy, link, gradient_bytes, tracer, profile)
    system.close()
    return 0


if __name__ == "__main__":
    run_worker(main)
