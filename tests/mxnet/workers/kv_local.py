"""Single process: a local store through ScheduledKVStore gives the same results as without."""

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from bytescheduler.mxnet.kvstore import ScheduledKVStore


def train(kv):
    mx.random.seed(1)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(16, activation="relu", in_units=8), gluon.nn.Dense(4, in_units=16))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                            kvstore=kv, update_on_kvstore=True)
    rng = np.random.RandomState(0)
    for _ in range(10):
        x = mx.nd.array(rng.uniform(-1, 1, (8, 8)))
        with autograd.record():
            loss = (net(x) ** 2).sum()
        loss.backward()
        trainer.step(8)
    return [v.data().asnumpy() for v in net.collect_params().values()]


def sums(kv):
    kv.init(3, mx.nd.ones((5, 5)))
    kv.push(3, [mx.nd.ones((5, 5)) * 2, mx.nd.ones((5, 5)) * 3])
    out = mx.nd.zeros((5, 5))
    kv.pull(3, out=out)
    pp = mx.nd.zeros((5, 5))
    kv.pushpull(3, mx.nd.ones((5, 5)) * 7, out=pp)
    return out.asnumpy(), pp.asnumpy()


def main():
    wrapped = ScheduledKVStore("local")
    assert wrapped.scheduler is None and wrapped.type == "local"
    a, b = sums(mx.kv.create("local")), sums(ScheduledKVStore(mx.kv.create("local")))
    assert all(np.array_equal(x, y) for x, y in zip(a, b)), (a, b)
    plain, ours = train(mx.kv.create("local")), train(wrapped)
    assert len(plain) == len(ours) == 4
    for x, y in zip(plain, ours):
        assert np.array_equal(x, y)
    wrapped.close()
    wrapped.close()
    # The kind is chosen at construction; a kind given the other kind of store is refused.
    from bytescheduler.mxnet.kvstore import DistKVStore, PassThroughKVStore
    assert type(wrapped) is PassThroughKVStore and isinstance(wrapped, ScheduledKVStore)
    try:
        DistKVStore("local")
    except TypeError as error:
        assert "create it with ScheduledKVStore(store, ...)" in str(error), error
    else:
        raise AssertionError("DistKVStore('local') was accepted")
    print("LOCAL OK")


if __name__ == "__main__":
    main()
