"""One torch rank of a soak or chaos job: ScheduledOptimizer, DDP + scheduled hook, or Horovod.

Started by :mod:`~bytescheduler_tools.bench.jobs`, never by hand::

    python -m bytescheduler_tools.bench.torch_trainee --adapter optimizer --rank 0 --world-size 2 \\
        --port 29500 --steps 200 --report /tmp/job/rank{rank}.jsonl

``--adapter``:

- ``optimizer``: ``bytescheduler.pytorch.ScheduledOptimizer`` over torch.distributed (gloo);
- ``hook``: ``DistributedDataParallel`` with ``scheduled_allreduce_hook`` and a plain SGD;
- ``horovod``: ``bytescheduler.pytorch.horovod.ScheduledOptimizer`` over
  ``hvd.DistributedOptimizer`` (the ``HOROVOD_*`` variables come from the job, as horovodrun
  would set them);
- ``ddp``: plain ``DistributedDataParallel`` without bytescheduler, a reference for the others.

Each adapter runs with its defaults as users get them (the mode switch on), plus ``timeout=``
when given. The loop is :mod:`~bytescheduler_tools.bench.rank_loop`'s. A rank whose training
raised closes the adapter with ``wait=False`` and exits with status 3 through the
interpreter's ordinary exit, as a user's script whose loop raised would.
"""

from __future__ import annotations

import argparse
import gc
import sys
from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import rank_loop
from .models import build

ADAPTERS = ("optimizer", "hook", "horovod", "ddp")


class TorchTrainee:
    """A model, its batch and an optimizer wrapped by one of the adapters (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        options = {} if args.timeout is None else {"timeout": args.timeout}
        torch.manual_seed(0)
        model, make_batch = build(args.model)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if args.adapter == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.rank = dist.get_rank()
            model = DDP(model)
            self.optimizer, self._adapter = sgd, None
        elif args.adapter == "hook":
            import bytescheduler.pytorch as bsp
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.rank = dist.get_rank()
            model = DDP(model)
            state = bsp.ScheduledHookState(**options)
            model.register_comm_hook(state, bsp.scheduled_allreduce_hook)
            self.optimizer, self._adapter = sgd, state
        elif args.adapter == "horovod":
            import horovod.torch as hvd
            import bytescheduler.pytorch.horovod as bsc

            self.rank = hvd.rank()
            inner = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
            self.optimizer = self._adapter = bsc.ScheduledOptimizer(model, inner, args.steps, **options)
        else:
            import bytescheduler.pytorch as bsp

            self.rank = dist.get_rank()
            self.optimizer = self._adapter = bsp.ScheduledOptimizer(model, sgd, **options)
        self.model = model
        self.inputs, self.targets = make_batch(args.batch_size, torch.Generator().manual_seed(self.rank))
        self.loss: Optional[torch.Tensor] = None

    def forward(self) -> None:
        self.optimizer.zero_grad()
        self.loss = F.cross_entropy(self.model(self.inputs), self.targets)

    def backward(self) -> None:
        self.loss.backward()
        self.loss = None

    def step(self) -> None:
        self.optimizer.step()

    def close(self) -> None:
        if self._adapter is not None:
            self._adapter.close(wait=True)

    def abandon(self) -> None:
        if self._adapter is not None:
            self._adapter.close(wait=False)

    def mode(self) -> Optional[str]:
        """The path of the mode switch (``scheduled`` or ``plain``); None when it is off.

        Read from the adapters' internals (the hook's ``driver``, the optimizers' ``_switch``),
        for the record only: None when they change.
        """
        switch = getattr(self._adapter, "driver", None) or getattr(
            getattr(self._adapter, "_bytescheduler", None), "_switch", None)
        return getattr(getattr(switch, "chooser", None), "mode", None)


def _join(args: argparse.Namespace) -> Callable[[], None]:
    """Join the job (gloo or Horovod); return what leaves it."""
    if args.adapter == "horovod":
        import horovod.torch as hvd

        hvd.init()
        return hvd.shutdown
    seconds = args.timeout if args.timeout is not None else 300.0
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=seconds))
    return dist.destroy_process_group


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", choices=ADAPTERS, required=True)
    parser.add_argument("--rank", type=int, default=0, help="gloo: this rank")
    parser.add_argument("--world-size", type=int, default=2, help="gloo: number of ranks")
    parser.add_argument("--port", type=int, default=0, help="gloo: rank 0's port on 127.0.0.1")
    rank_loop.add_arguments(parser)
    args = parser.parse_args(argv)
    rank_loop.dump_stacks_on_signal()
    torch.set_num_threads(1)
    leave = _join(args)
    trainee = TorchTrainee(args)
    status = rank_loop.run(trainee, args)
    if status != 0:
        return status  # as a script whose loop raised: no orderly goodbye to the dead peer
    # DDP's hooks refer to the module (a cycle only the collector frees) and DDP holds the
    # process group: free them before ending it, or gloo's threads outlive the interpreter.
    del trainee
    gc.collect()
    leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
