"""dist_sync worker: the mode switch times whole steps on both paths, in a loop that never waits.

gluon's Trainer trains a model of one 32 MB layer through a ScheduledKVStore with the mode
switch on and short phases; the loop never waits for MXNet (no ``asnumpy``, no ``waitall``),
so MXNet's calls return before they run. Rank 0's first verdict compares the step times of
both paths; a step is the time from one step's first push to the next one's, and the plain
path's calls return at once: unless the store waits for the steps' calls to complete, its
steps look as short as queueing them. Prints ``CLOCK rank=0 scheduled=S plain=P`` (median seconds).
"""

import os
import statistics

import mxnet as mx
from mxnet import autograd, gluon

from bytescheduler.launcher import run_worker

STEPS = 16
BATCH = 8


def main() -> None:
    from bytescheduler.core import modes
    from bytescheduler.mxnet.kvstore import ScheduledKVStore

    # warm-up 2, then one pair of 3-step trials (a step each to settle), decided at once
    os.environ["BYTESCHEDULER_MODE_SWITCH"] = modes.ModeSwitchParams(warmup=2, settle=1, trial=3, pairs=1, hold=50, trial_seconds=0, clear_hold=1, min_clear_samples=1, min_retrial=3).text()
    kv = ScheduledKVStore("dist_sync", adaptive=True, timeout=60)
    mx.random.seed(3)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(4096, in_units=2048, activation="relu"), gluon.nn.Dense(10, in_units=4096))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01}, kvstore=kv, update_on_kvstore=True)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x = mx.nd.random.uniform(-1, 1, (BATCH, 2048))
    y = mx.nd.array([i % 10 for i in range(BATCH)])
    for _ in range(STEPS):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(BATCH)
    kv.synchronize()
    if kv.rank == 0:
        verdicts = kv.driver.chooser.verdicts
        assert verdicts, kv.driver.chooser.history
        first = verdicts[0]
        print(f"CLOCK rank=0 scheduled={statistics.median(first['scheduled_s']):.6f} "
              f"plain={statistics.median(first['plain_s']):.6f} history={''.join(m[0] for m in kv.driver.chooser.history)}")
    kv.close()
    print(f"DONE rank={kv.rank}")


if __name__ == "__main__":
    run_worker(main)
