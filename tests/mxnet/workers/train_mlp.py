"""gluon MLP training, 20 steps; saves the parameters.

    train_mlp.py MODE PREFIX [--update-on-kv] [--overlap] [--hybrid] [--partition BYTES]
                 [--grain BYTES] [--repartition STEP:BYTES ...] [--auto-tune] [--adaptive] [--plan-plain]

MODE:
  plain      a dist_sync worker with kvstore="dist_sync" (unwrapped)
  wrapped    a dist_sync worker with ScheduledKVStore (partition 1024 B by default, so the first
             layer's weight, 64x20 float32 = 5,120 bytes, goes as 5 pieces)
  reference  one process, no kvstore: each step adds the gradients of rank 0's and rank 1's
             batches (a + b is exact and commutative) and applies the same local update

``--jitter`` makes every worker pause at random each step and the last one join 3 s late;
``--workers N`` makes the reference sum N workers' batches (for jobs of N workers).
A worker saves PREFIX-rank{R}.params, the reference PREFIX-reference.params. ``--repartition
5:4096`` calls ``kv.set_partition_bytes(4096)`` before step 5 (wrapped only). ``--auto-tune``
lets rank 0's tuner change partition and credit during training; it prints the settings tried.
``--adaptive`` turns the mode switch on with short phases, so that steps alternate between
the schedule and MXNet's own calls; it prints the mode of every step (s or p). Without it the
wrapped store schedules every step. ``--rank1-env`` leaves ``adaptive`` to the environment
and gives rank 1 alone a few bytescheduler variables (``BYTESCHEDULER_ADAPTIVE=0`` among
them): the workers must still agree, on rank 0's settings; it prints the settings in force
and rank 1's warnings. ``--plan-plain`` gives the store a plan that says "don't schedule"
(``plan=PREFIX-plan.json``): the mode switch starts on MXNet's own calls.
"""

import argparse
import json
import os
import random
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from bytescheduler.launcher import run_worker

STEPS = 20
BATCH = 16
# What rank 1 alone sets with --rank1-env.
RANK1_ENV = {"BYTESCHEDULER_ADAPTIVE": "0", "BYTESCHEDULER_CYCLE_TIME": "5", "BYTESCHEDULER_FAST_LANE": "0"}
OPTIMIZER = ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4})


def build_net(hybrid):
    mx.random.seed(42)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(64, activation="relu", in_units=20), gluon.nn.Dense(32, activation="relu", in_units=64),
            gluon.nn.Dense(10, in_units=32))
    net.initialize(mx.init.Xavier())
    if hybrid:
        net.hybridize()
    return net


def batches(rank):
    """The batches rank ``rank`` trains on, step by step."""
    rng = np.random.RandomState(rank)
    for _ in range(STEPS):
        yield mx.nd.array(rng.uniform(-1, 1, (BATCH, 20))), mx.nd.array(rng.randint(0, 10, (BATCH,)))


def backward(net, loss_fn, x, y):
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    return loss


def reference(args) -> None:
    net = build_net(args.hybrid)
    params = list(net.collect_params().values())
    trainer = gluon.Trainer(net.collect_params(), *OPTIMIZER, kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step_batches in zip(*(batches(rank) for rank in range(args.workers))):
        grads = []
        for x, y in step_batches:
            backward(net, loss_fn, x, y)
            grads.append([p.grad().copy() for p in params])
        for param, per_rank in zip(params, zip(*grads)):
            total = per_rank[0]
            for grad in per_rank[1:]:
                total = total + grad
            param.grad()[:] = total
        trainer.step(BATCH)
    mx.nd.waitall()
    net.save_parameters(f"{args.prefix}-reference.params")
    print("DONE reference")


def worker(args) -> None:
    net = build_net(args.hybrid)
    if args.mode == "wrapped":
        from bytescheduler.core import modes
        from bytescheduler.mxnet.kvstore import ScheduledKVStore
        os.environ["BYTESCHEDULER_MODE_SWITCH"] = modes.ModeSwitchParams(warmup=2, settle=1, trial=2, pairs=2, hold=3, trial_seconds=0, clear_hold=1, min_retrial=2).text()
        store = mx.kv.create("dist_sync")
        warnings = []
        if args.rank1_env:
            import logging
            handler = logging.Handler()
            handler.emit = lambda record: warnings.append(record.getMessage())
            logging.getLogger("bytescheduler").addHandler(handler)
            if store.rank == 1:
                os.environ.update(RANK1_ENV)
        plan = None
        if args.plan_plain:
            from bytescheduler.core.plan import Plan
            plan = f"{args.prefix}-plan-rank{store.rank}.json"
            with open(plan, "w") as handle:
                handle.write(Plan(False, args.partition, 4096).to_json())
        kv = ScheduledKVStore(store, partition_bytes=args.partition, grain_bytes=args.grain, credit_bytes=4096,
                              timeout=60, auto_tune=args.auto_tune,
                              adaptive=None if args.rank1_env else args.adaptive, plan=plan)
    else:
        kv = mx.kv.create("dist_sync")
    rank = kv.rank
    jitter = random.Random(1000 + rank)
    if args.jitter and rank == kv.num_workers - 1:
        time.sleep(3.0)  # joins late: the others wait in the first (collective) init
    trainer = gluon.Trainer(net.collect_params(), *OPTIMIZER, kvstore=kv, update_on_kvstore=args.update_on_kv)
    if args.mode == "wrapped" and args.overlap:
        kv.overlap(net)
    repartition = dict(args.repartition)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step, (x, y) in enumerate(batches(rank)):
        if step in repartition:
            kv.set_partition_bytes(repartition[step])
            print(f"REPARTITION rank={rank} step={step} partition_bytes={kv.partition_bytes}")
        if args.jitter:
            time.sleep(jitter.uniform(0.0, 0.02))
        loss = backward(net, loss_fn, x, y)
        if args.jitter:
            time.sleep(jitter.uniform(0.0, 0.02))
        trainer.step(BATCH)
    if args.mode == "wrapped":
        kv.synchronize()
        if kv.driver is not None:
            history = "".join(mode[0] for mode in kv.driver.chooser.history)
            scheduled = history.count("s") + 1  # the last step ends only at the next push
            print(f"MODES rank={rank} {history}")
        else:
            scheduled = STEPS
        assert kv.scheduler.stats["pieces"] > scheduled * 6, kv.scheduler.stats
        print(f"STATS rank={rank} {kv.scheduler.stats}")
        if args.rank1_env:
            settings = {f: getattr(kv._config, f) for f in ("adaptive", "cycle_ms", "fast_lane_bytes", "timeout")}
            print(f"SETTINGS rank={rank} {json.dumps(settings, sort_keys=True)}")
            print(f"WARNINGS rank={rank} {json.dumps([w for w in warnings if 'rank 0' in w])}")
        tuner = kv.scheduler.tuner
        if tuner is not None:
            print(f"TUNING rank={rank} settings={[[t.partition_bytes, t.credit_bytes] for t in tuner.history]}")
    mx.nd.waitall()
    net.save_parameters(f"{args.prefix}-rank{rank}.params")
    if args.mode == "wrapped":
        kv.close()
    print(f"DONE rank={rank} loss={loss.mean().asscalar():.6f}")


def step_bytes(text):
    step, _, size = text.partition(":")
    return int(step), int(size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["plain", "wrapped", "reference"])
    parser.add_argument("prefix")
    parser.add_argument("--update-on-kv", action="store_true")
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--hybrid", action="store_true")
    parser.add_argument("--partition", type=int, default=1024)
    parser.add_argument("--grain", type=int, default=None)
    parser.add_argument("--repartition", type=step_bytes, nargs="*", default=[])
    parser.add_argument("--auto-tune", action="store_true")
    parser.add_argument("--adaptive", action="store_true")
    parser.add_argument("--rank1-env", action="store_true")
    parser.add_argument("--plan-plain", action="store_true")
    parser.add_argument("--workers", type=int, default=2, help="reference: the number of workers' batches summed")
    parser.add_argument("--jitter", action="store_true", help="random pauses every step; the last worker starts late")
    args = parser.parse_args()
    if args.mode == "reference":
        reference(args)
    else:
        worker(args)


if __name__ == "__main__":
    run_worker(main)
