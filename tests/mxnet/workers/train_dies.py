"""dist_sync worker: gluon training through ScheduledKVStore; the worker started second dies.

    train_dies.py EXIT_CODE

At step 5 the worker with launch index 1 ends at once with ``os._exit(EXIT_CODE)`` (no clean-up,
like a crash), in the middle of training. The other one trains on (no synchronisation inside a
step) with a 5 s communication timeout.
"""

import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from bytescheduler.launcher import run_worker

TIMEOUT = 5.0
DIE_AT = 5


def main(exit_code: str) -> None:
    from bytescheduler.mxnet.kvstore import ScheduledKVStore
    mx.random.seed(0)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(64, activation="relu", in_units=20), gluon.nn.Dense(10, in_units=64))
    net.initialize(mx.init.Xavier())
    kv = ScheduledKVStore("dist_sync", partition_bytes=1024, timeout=TIMEOUT)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv,
                            update_on_kvstore=True)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(kv.rank)
    dies = os.environ["BYTESCHEDULER_LAUNCH_INDEX"] == "1"
    for step in range(1000):
        if dies and step == DIE_AT:
            print(f"DYING rank={kv.rank} step={step} code={exit_code}", flush=True)
            os._exit(int(exit_code))
        x, y = mx.nd.array(rng.uniform(-1, 1, (16, 20))), mx.nd.array(rng.randint(0, 10, (16,)))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(16)
        print(f"STEP rank={kv.rank} step={step}", flush=True)
    raise AssertionError("training went on although a worker died")


if __name__ == "__main__":
    run_worker(main, sys.argv[1])
