"""One MXNet worker of a soak or chaos job: gluon training through ``ScheduledKVStore("dist_sync")``.

Started by :mod:`~bytescheduler_tools.bench.jobs` under ``bytescheduler mxnet-launch`` (one
scheduler, one server, two workers on 127.0.0.1), never by hand; imports no torch::

    python -m bytescheduler.launcher -n 2 -s 1 --deadline 600 -- \\
        python -m bytescheduler_tools.bench.mxnet_trainee --steps 200 --report /tmp/job/rank{rank}.jsonl

The store runs with its defaults as users get them (the mode switch on), plus ``timeout=``
when given; the trainer updates on the servers (``update_on_kvstore=True``). The worker's
rank is the store's (the scheduler assigns it), so ``--fault-rank 1`` hurts ``kv.rank == 1``.

MXNet runs operators asynchronously: a Python call only queues them. So that a phase is
the time its work runs (and a fault lands where it says), ``forward`` ends by waiting for the
loss and ``backward`` for the first layer's gradient (computed last), as a loop that logs
its loss each step does. ``step`` is ``trainer.step``: the pushes and pulls, not waited for.

The worker runs through :func:`bytescheduler.launcher.run_worker`: a rank whose training
raised ends at once with status 3 (ps-lite's exit barrier would wait for the dead peer), and
the launcher then stops the job.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import mxnet as mx
from mxnet import autograd, gluon

from bytescheduler.launcher import run_worker
from . import rank_loop
from .mxnet_models import build


class MXNetTrainee:
    """A gluon model trained through a ScheduledKVStore with server-side SGD."""

    def __init__(self, args: argparse.Namespace) -> None:
        from bytescheduler.mxnet.kvstore import ScheduledKVStore

        options = {} if args.timeout is None else {"timeout": args.timeout}
        self.kv = ScheduledKVStore("dist_sync", **options)
        self.rank = self.kv.rank
        mx.random.seed(0)
        self.net, make_batch = build(args.model)
        self.net.initialize(mx.init.Xavier())
        self.first = list(self.net.collect_params().values())[0]
        self.trainer = gluon.Trainer(self.net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                     kvstore=self.kv, update_on_kvstore=True)
        self.loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        self.batch_size = args.batch_size
        self.inputs, self.labels = make_batch(args.batch_size, self.rank)
        self.loss = None

    def forward(self) -> None:
        with autograd.record():
            self.loss = self.loss_fn(self.net(self.inputs), self.labels)
        self.loss.wait_to_read()

    def backward(self) -> None:
        self.loss.backward()
        self.first.grad().wait_to_read()

    def step(self) -> None:
        self.trainer.step(self.batch_size)

    def close(self) -> None:
        self.kv.close(wait=True)

    def abandon(self) -> None:
        self.kv.close(wait=False)

    def mode(self) -> Optional[str]:
        """The path of the store's mode switch (``scheduled`` or ``plain``); None when it is off."""
        return getattr(self.kv.driver, "mode", None)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    rank_loop.add_arguments(parser)
    args = parser.parse_args(argv)
    rank_loop.dump_stacks_on_signal()
    trainee = MXNetTrainee(args)
    status = rank_loop.run(trainee, args)
    if status != 0:
        # run_worker ends the process at once, while this frame (and so the store, whose
        # destructor would wait for the dead peer in ps-lite's exit barrier) is still referenced.
        raise SystemExit(status)


if __name__ == "__main__":
    run_worker(main)
