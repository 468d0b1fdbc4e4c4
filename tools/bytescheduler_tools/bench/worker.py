"""One rank of a PyTorch benchmark job: every system trains its own copy of the model, in turns.

Run by :mod:`bytescheduler_tools.bench.runner`, never by hand. ``--backend gloo`` (torch.distributed:
compute, comm, ddp, ddp-hook, scheduled) or ``--backend horovod`` (hvd: ``hvd.DistributedOptimizer``;
hvd-scheduled: bytescheduler's ``ScheduledOptimizer`` over it). Each round runs every system for
a timed block of iterations, one after another, so slow drift of the machine affects all
systems alike; a barrier starts each block and the system's flush (waiting for pending
communication) ends it inside the timed block (see :func:`bytescheduler_tools.bench.common.run_blocks`).

Horovod ranks are started as horovodrun does (``HOROVOD_*`` variables) but without it, so
that they can run in the testbed's namespaces; ``--rendezvous-port-file`` names the file in
which :mod:`bytescheduler_tools.bench.rendezvous` writes the port of Horovod's rendezvous server.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from datetime import timedelta
from typing import Callable, Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .models import build
from . import common
from .common import LINK_MEGABYTES, Tracer, add_arguments, link_rate, record_timeline, run_blocks, write_result


class System(common.System):
    """A torch model and optimizer; the forward, backward and step of an iteration are traced."""

    def __init__(self, name: str, model: torch.nn.Module, optimizer, make_batch, batch_size: int, rank: int,
                 tracer: Tracer) -> None:
        self.name = name
        self.model = model
        self.optimizer = optimizer
        self.inputs, self.targets = make_batch(batch_size, torch.Generator().manual_seed(rank))
        self.tracer = tracer

    def iterate(self) -> None:
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(self.inputs), self.targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        self.tracer.span(self.name, "forward", t0, t1)
        self.tracer.span(self.name, "backward", t1, t2)
        self.tracer.span(self.name, "step", t2, t3)


class CommunicationOnly(System):
    """All-reduces tensors of the gradients' sizes, last layer first, with no computation."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.buffers = [torch.zeros_like(p) for p in self.model.parameters()][::-1]
        self.group = dist.new_group(list(range(dist.get_world_size())))

    def iterate(self) -> None:
        start = time.perf_counter()
        works = [dist.all_reduce(t, group=self.group, async_op=True) for t in self.buffers]
        for work in works:
            work.wait()
        self.tracer.span(self.name, "all-reduce", start, time.perf_counter())


class Scheduled(System):
    @property
    def tuned(self) -> bool:
        return self.optimizer._bytescheduler.scheduler.config.auto_tune

    def flush(self) -> None:
        self.optimizer.synchronize()

    def stats(self) -> dict:
        return self.optimizer._bytescheduler.scheduler.stats

    def trace(self, active: bool) -> None:
        record_timeline(self.optimizer._bytescheduler.scheduler, active)

    def mode_switch(self):
        engine = self.optimizer._bytescheduler
        return engine if engine.chooser is not None else None

    def close(self) -> None:
        self.optimizer.close()


class HookedDDP(System):
    def __init__(self, *args, state=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = state
        self.tuned = state.scheduler.config.auto_tune

    def stats(self) -> dict:
        return self.state.scheduler.stats

    def trace(self, active: bool) -> None:
        record_timeline(self.state.scheduler, active)

    def mode_switch(self):
        return self.state.driver

    def close(self) -> None:
        self.state.close()


class FusedStep:
    """The training loop's optimizer for DDP with ``_register_fused_optim``: DDP updates each
    bucket's parameters right after its all-reduce, so ``step()`` has nothing left to do."""

    def __init__(self, ddp: torch.nn.Module) -> None:
        self._ddp = ddp

    def zero_grad(self) -> None:
        self._ddp.zero_grad(set_to_none=True)

    def step(self) -> None:
        pass


def _make_systems(args, rank: int, tracer: Tracer) -> Dict[str, System]:
    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    options = dict(partition_bytes=args.partition, credit_bytes=args.credit, auto_tune=bool(args.auto_tune))
    systems: Dict[str, System] = {}
    common = dict(batch_size=args.batch_size, rank=rank, tracer=tracer)
    for name in args.systems:
        torch.manual_seed(0)
        model, make_batch = build(args.model)
        timeline = os.path.join(args.trace_dir, f"{name}.json") if args.trace_dir else None
        if name == "compute":
            systems[name] = System(name, model, sgd(model), make_batch, **common)
        elif name == "comm":
            systems[name] = CommunicationOnly(name, model, sgd(model), make_batch, **common)
        elif name == "ddp-fused":  # PyTorch's own overlap of the optimizer with backward
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(model)
            ddp._register_fused_optim(torch.optim.SGD, lr=0.01, momentum=0.9)
            systems[name] = System(name, ddp, FusedStep(ddp), make_batch, **common)
        elif name in ("ddp", "ddp-hook", "ddp-torch-hook", "ddp-again"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(model)
            if name == "ddp-torch-hook":  # what any Python comm hook costs against DDP's built-in path
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            if name != "ddp-hook":
                systems[name] = System(name, ddp, sgd(ddp), make_batch, **common)
                continue
            import bytescheduler.pytorch as bsp

            state = bsp.ScheduledHookState(timeline=timeline, **options)
            ddp.register_comm_hook(state, bsp.scheduled_allreduce_hook)
            systems[name] = HookedDDP(name, ddp, sgd(ddp), make_batch, state=state, **common)
        elif name == "scheduled":
            import bytescheduler.pytorch as bsp

            optimizer = bsp.ScheduledOptimizer(model, sgd(model), timeline=timeline, **options)
            systems[name] = Scheduled(name, model, optimizer, make_batch, **common)
        elif name in ("hvd", "hvd-scheduled", "hvd-again"):
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
            if name != "hvd-scheduled":
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                systems[name] = System(name, model, optimizer, make_batch, **common)
                continue
            import bytescheduler.pytorch.horovod as bsc

            optimizer = bsc.ScheduledOptimizer(model, optimizer, timeline=timeline, **options)
            systems[name] = Scheduled(name, model, optimizer, make_batch, **common)
        else:
            raise ValueError(f"unknown system {name!r}")
    return systems


def start_gloo(args) -> Callable[[], None]:
    """Join the torch.distributed job; return what ends it."""
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=600))
    return dist.destroy_process_group


def set_hostname(name: str) -> None:
    """Give this process a hostname of its own, in a private UTS namespace (needs root).

    Horovod 0.28.1 creates the gloo device of each process set (the global one included)
    from the machine's hostname, not from ``HOROVOD_GLOO_IFACE``; in a testbed namespace
    that name resolves to 127.0.0.1, which the other ranks cannot reach. Named by the
    rank's own address, the hostname resolves to it without any hosts file.
    """
    import ctypes
    import socket

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x04000000) != 0:  # CLONE_NEWUTS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) failed")
    socket.sethostname(name)


def start_horovod(args) -> Callable[[], None]:
    """Wait for the rendezvous server's port, then ``hvd.init()``; return what ends Horovod."""
    import horovod.torch as hvd

    if args.hostname:
        set_hostname(args.hostname)
    end = time.monotonic() + 120
    while not os.path.exists(args.rendezvous_port_file):
        if time.monotonic() > end:
            raise TimeoutError(f"no rendezvous port in {args.rendezvous_port_file} after 120 s")
        time.sleep(0.05)
    with open(args.rendezvous_port_file) as handle:
        os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"] = handle.read().strip()
    hvd.init()
    return hvd.shutdown


def _link_rate(allreduce: Callable[[torch.Tensor], None], barrier: Callable[[], None], world: int) -> float:
    tensor = torch.zeros(LINK_MEGABYTES * 2**20 // 4)
    return link_rate(lambda: allreduce(tensor), barrier, world)


def add_rank_arguments(parser: argparse.ArgumentParser) -> None:
    """How a rank joins its job (what :func:`start_gloo` and :func:`start_horovod` read), as the
    runner's ``torch_ranks`` and ``horovod_ranks`` pass it."""
    parser.add_argument("--backend", choices=("gloo", "horovod"), default="gloo")
    parser.add_argument("--rank", type=int, help="gloo: this rank")
    parser.add_argument("--world-size", type=int, help="gloo: number of ranks")
    parser.add_argument("--master", help="gloo: rank 0's address")
    parser.add_argument("--port", type=int, help="gloo: rank 0's port")
    parser.add_argument("--rendezvous-port-file", help="horovod: where the rendezvous server's port appears")
    parser.add_argument("--hostname", help="horovod: run under this hostname (this rank's address in a namespace)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rank_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    if args.backend == "horovod":
        import horovod.torch as hvd

        shutdown = start_horovod(args)
        rank, world, barrier = hvd.rank(), hvd.size(), hvd.barrier

        def allreduce(tensor: torch.Tensor) -> None:
            hvd.allreduce_(tensor, op=hvd.Sum, name="bytescheduler_tools.bench.link")
    else:
        shutdown = start_gloo(args)
        rank, world, barrier = args.rank, args.world_size, dist.barrier
        allreduce = dist.all_reduce
    tracer = Tracer(rank)
    systems = _make_systems(args, rank, tracer)
    link = 0.0 if args.no_link else _link_rate(allreduce, barrier, world)
    gradient_bytes = sum(p.numel() * p.element_size() for p in next(iter(systems.values())).model.parameters())
    times, rss, busy, profile = run_blocks(systems, args, barrier, tracer, rank)
    write_result(args, rank, systems, times, rss, busy, link, gradient_bytes, tracer, profile)
    for system in systems.values():
        system.close()
    # Free the models (DDP holds the process group) before ending it, so gloo's threads end
    # with the group instead of outliving the interpreter (an abort at exit otherwise).
    # DDP's hooks refer to the module: a reference cycle only the collector frees.
    systems.clear()
    gc.collect()
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
