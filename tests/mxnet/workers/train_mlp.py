"""dist_sync worker: train a small MLP with gluon for 20 steps; save the parameters.

    train_mlp.py MODE UPDATE_ON_KV OVERLAP HYBRID OUTFILE_PREFIX

MODE: plain (kvstore="dist_sync") | wrapped (ScheduledKVStore, partition_bytes=1024, so the
first layer's weight, 64x20 float32 = 5,120 bytes, goes as 5 sub-keys).
"""

import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from bytescheduler.mxnet.launch import run_worker

STEPS = 20


def main(mode, update_on_kv, overlap, hybrid, prefix) -> None:
    update_on_kv, overlap, hybrid = update_on_kv == "1", overlap == "1", hybrid == "1"
    mx.random.seed(42)
    np.random.seed(42)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(64, activation="relu", in_units=20), gluon.nn.Dense(32, activation="relu", in_units=64),
            gluon.nn.Dense(10, in_units=32))
    net.initialize(mx.init.Xavier())
    if hybrid:
        net.hybridize()
    if mode == "wrapped":
        from bytescheduler.mxnet.kvstore import ScheduledKVStore
        kv = ScheduledKVStore("dist_sync", partition_bytes=1024, credit_bytes=4096, timeout=60)
    else:
        kv = mx.kv.create("dist_sync")
    rank = kv.rank
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4},
                            kvstore=kv, update_on_kvstore=update_on_kv)
    if mode == "wrapped" and overlap:
        kv.overlap(net)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(rank)
    for step in range(STEPS):
        x = mx.nd.array(rng.uniform(-1, 1, (16, 20)))
        y = mx.nd.array(rng.randint(0, 10, (16,)))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(16)
    if mode == "wrapped":
        kv.synchronize()
        assert kv.scheduler.stats["pieces"] > STEPS * 6, kv.scheduler.stats
        print(f"STATS rank={rank} {kv.scheduler.stats}")
    mx.nd.waitall()
    net.save_parameters(f"{prefix}-rank{rank}.params")
    if mode == "wrapped":
        kv.close()
    print(f"DONE rank={rank} loss={loss.mean().asscalar():.6f}")


if __name__ == "__main__":
    run_worker(main, *sys.argv[1:6])
