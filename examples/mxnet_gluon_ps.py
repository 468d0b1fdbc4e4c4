"""A gluon CNN on synthetic data, trained through MXNet's parameter server, with or without bytescheduler.

    bytescheduler mxnet-launch -n 2 -s 2 -- python examples/mxnet_gluon_ps.py --partition 512KiB
    bytescheduler mxnet-launch -n 2 -s 2 -- python examples/mxnet_gluon_ps.py --no-bytescheduler

Each worker trains the same small CNN (two convolutions, two dense layers, 4.3 MB of
parameters) on its own random images with server-side SGD (``update_on_kvstore=True``).
With bytescheduler the ``dist_sync`` store is wrapped in a ``ScheduledKVStore``: every
gradient is a task of the scheduler as soon as it is computed, the large dense layer goes in
pieces of ``--partition`` bytes under a credit of ``--credit`` bytes, the first layers go
first, and each block's next forward waits only for its own parameters (``kv.overlap``).

Prints the median time per iteration (from the moment one step's loss is ready to the next
one's, so communication still overlaps the next forward) and, at the end, a checksum of the
parameters: scheduling changes the order of communication, not the math, so both runs print
the same checksum.
"""

import argparse
import hashlib
import statistics
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon import nn

from bytescheduler.launcher import run_worker


def build_net() -> nn.Sequential:
    net = nn.Sequential()
    net.add(nn.Conv2D(32, 3, padding=1, in_channels=3, activation="relu"), nn.MaxPool2D(2),
            nn.Conv2D(64, 3, padding=1, in_channels=32, activation="relu"), nn.MaxPool2D(2),
            nn.Flatten(), nn.Dense(256, in_units=64 * 8 * 8, activation="relu"), nn.Dense(10, in_units=256))
    return net


def checksum(net) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(net.collect_params().items()):
        digest.update(name.encode())
        digest.update(param.data().asnumpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=3, help="iterations before timing")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--partition", default=None, help="partition size, e.g. 512KiB (default 4MiB)")
    parser.add_argument("--credit", default=None, help="credit size, e.g. 2MiB (default 16MiB)")
    parser.add_argument("--no-bytescheduler", action="store_true", help="the plain dist_sync store")
    args = parser.parse_args()

    kv = mx.kv.create("dist_sync")
    if not args.no_bytescheduler:
        from bytescheduler.mxnet.kvstore import ScheduledKVStore
        kv = ScheduledKVStore(kv, partition_bytes=args.partition, credit_bytes=args.credit)
    mx.random.seed(0)
    net = build_net()
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                            kvstore=kv, update_on_kvstore=True)
    if not args.no_bytescheduler:
        kv.overlap(net)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(kv.rank)
    x = mx.nd.array(rng.uniform(-1, 1, (args.batch_size, 3, 32, 32)))
    y = mx.nd.array(rng.randint(0, 10, (args.batch_size,)))

    ready = []
    for _ in range(args.warmup + args.steps):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(args.batch_size)
        loss.wait_to_read()
        ready.append(time.perf_counter())
    if not args.no_bytescheduler:
        kv.synchronize()
    mx.nd.waitall()

    times = np.diff(ready[args.warmup - 1:]) if args.warmup > 0 else np.diff(ready)
    label = "plain dist_sync" if args.no_bytescheduler else "bytescheduler"
    median = statistics.median(times) if len(times) else float("nan")
    print(f"rank {kv.rank}: {label}: median {median * 1000:.1f} ms per iteration over {len(times)} "
          f"iterations, {args.batch_size / median:.1f} samples/s per worker, final loss "
          f"{loss.mean().asscalar():.4f}")
    if not args.no_bytescheduler and kv.rank == 0:
        print(f"rank 0: scheduler {kv.scheduler.stats}")
    print(f"rank {kv.rank}: CHECKSUM {checksum(net)}")
    if not args.no_bytescheduler:
        kv.close()


if __name__ == "__main__":
    run_worker(main)
