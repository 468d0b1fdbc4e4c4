"""One rank of ``bytescheduler calibrate`` over torch.distributed (gloo) or Horovod: what operations cost.

Run by :mod:`bytescheduler_tools.sim.calibrate` (started as ``bytescheduler bench`` starts its
ranks), never by hand. Every phase starts at a barrier and records the wall time, this
process's threads' CPU and the kernel's interrupt work on the CPU the rank is pinned to
(:class:`~bytescheduler_tools.sim.usage.Usage`):

* ``memcpy``: one thread copying 64 MiB (the machine's copy rate);
* ``idle``: a second with nothing to do (Horovod's background thread turns anyway);
* ``small``: one-element all-reduces, one after another (the fixed cost of an operation);
* ``large``: all-reduces of ``--megabytes`` (the rate, and the CPU per byte);
* ``ours``: bytescheduler's ScheduledOptimizer (scheduled path only) training a model of
  many small layers: its dispatcher's CPU per operation and the training thread's backward
  (its gradient hooks); with Horovod also the CPU of one poll of a handle (the completion
  poller's unit of work);
* ``hooks``: the same model's backward on the training thread, plain and with the
  framework's own wrapper (DDP; Horovod's DistributedOptimizer): its gradient hooks' CPU.

Writes one JSON per rank (``--output``, ``{rank}`` replaced).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import threading
import time
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from ..bench.common import pinned_cpu, thread_cpu_seconds, thread_roles
from ..bench.worker import add_rank_arguments, start_gloo, start_horovod
from .usage import Usage, repeat

_COPY_BYTES = 64 * 2**20


def memcpy_rate(repeats: int = 8) -> float:
    """Bytes per second one thread copies (best of ``repeats`` copies of 64 MiB)."""
    source = torch.ones(_COPY_BYTES // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return _COPY_BYTES / best


def _thread_cpu(names: tuple) -> float:
    """CPU seconds so far of this process's threads whose name starts with one of ``names``."""
    seconds = thread_cpu_seconds()
    return sum(seconds.get(tid, 0.0) for tid, (_, name) in thread_roles().items() if name.startswith(names))


def layered_model() -> torch.nn.Module:
    """Many small layers (48 gradients of 256 KiB or 1 KiB): per-gradient costs dominate."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(24)])


def backward_cpu(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 20,
                 warmup: int = 5) -> float:
    """Median CPU seconds of the training thread's backward pass (its gradient hooks included)
    over ``steps`` after ``warmup``; 0 without steps (a warm-up only)."""
    inputs = torch.randn(16, 256)
    samples = []
    for _ in range(warmup + steps):
        optimizer.zero_grad()
        loss = model(inputs).square().mean()
        start = time.thread_time()
        loss.backward()
        samples.append(time.thread_time() - start)
        optimizer.step()
    return statistics.median(samples[warmup:]) if steps else 0.0


def scheduled_cost(make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer], steps: int = 30,
                   warmup: int = 5) -> Dict[str, float]:
    """Our dispatcher's (and poller's) CPU, and the training thread's backward, over ``steps``
    of :func:`layered_model` with ScheduledOptimizer."""
    model = layered_model()
    optimizer = make_optimizer(model)
    scheduler = optimizer._bytescheduler.scheduler
    backward_cpu(model, optimizer, 0, warmup)
    optimizer.synchronize()
    operations = scheduler.stats["operations"]
    dispatch, poll = _thread_cpu(("bytescheduler-dispatch",)), _thread_cpu(("bytescheduler-horovod-poll",))
    backward = backward_cpu(model, optimizer, steps, 0)
    optimizer.synchronize()
    result = {"operations": scheduler.stats["operations"] - operations,
              "dispatch_cpu": _thread_cpu(("bytescheduler-dispatch",)) - dispatch,
              "poll_cpu": _thread_cpu(("bytescheduler-horovod-poll",)) - poll, "backward_cpu": backward}
    optimizer.close()
    return result


def hook_costs(wrap: Callable[[torch.nn.Module], tuple]) -> Dict[str, float]:
    """The training thread's backward of :func:`layered_model`, plain and with the framework's
    own data-parallel wrapper (``wrap(model) -> (model, optimizer)``: DDP, Horovod's
    DistributedOptimizer): what its gradient hooks cost."""
    model = layered_model()
    plain = backward_cpu(model, torch.optim.SGD(model.parameters(), lr=0.01))
    wrapped = backward_cpu(*wrap(layered_model()))
    return {"gradients": len(list(model.parameters())),
            "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "plain_backward_cpu": plain, "framework_backward_cpu": wrapped}


def poll_cost(poll: Callable[[], object], repeats: int = 3000) -> float:
    """CPU seconds of one wake-up of a poller: one poll and one short sleep."""
    tid = threading.get_native_id()
    before = thread_cpu_seconds().get(tid, 0.0)
    for _ in range(repeats):
        poll()
        time.sleep(1e-5)
    return (thread_cpu_seconds().get(tid, 0.0) - before) / repeats


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rank_arguments(parser)
    parser.add_argument("--small-ops", type=int, default=300)
    parser.add_argument("--large-ops", type=int, default=6)
    parser.add_argument("--megabytes", type=int, default=32)
    parser.add_argument("--output", required=True, help="JSON per rank; {rank} is replaced")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report: Dict[str, object] = {"backend": args.backend, "pinned": pinned_cpu() is not None}
    small = torch.zeros(1)
    large = torch.zeros(args.megabytes * 2**20 // 4)
    if args.backend == "horovod":
        import horovod.torch as hvd

        shutdown = start_horovod(args)
        rank, world, barrier = hvd.rank(), hvd.size(), hvd.barrier

        def allreduce(tensor: torch.Tensor) -> None:
            hvd.allreduce_(tensor, op=hvd.Average, name=f"bytescheduler.calibrate.{tensor.numel()}")

        def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
            import bytescheduler.pytorch.horovod as bsc

            inner = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             named_parameters=model.named_parameters())
            return bsc.ScheduledOptimizer(model, inner, 0, adaptive=False)

        def wrap(model: torch.nn.Module) -> tuple:
            return model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                                   named_parameters=model.named_parameters())
        report["cycle_seconds"] = float(os.environ.get("HOROVOD_CYCLE_TIME", "1")) / 1000.0
    else:
        shutdown = start_gloo(args)
        rank, world, barrier = args.rank, args.world_size, dist.barrier
        allreduce = dist.all_reduce

        def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
            import bytescheduler.pytorch as bsp

            return bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01), adaptive=False)

        def wrap(model: torch.nn.Module) -> tuple:
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(model)
            return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)
    report.update(rank=rank, world=world, memcpy_bytes_per_s=memcpy_rate())
    usage = Usage()
    for _ in range(20):  # warm up: connections, Horovod's response cache
        allreduce(small)
    allreduce(large)
    barrier()
    report["idle"] = repeat(usage, lambda: time.sleep(1.0), 1)

    barrier()
    report["small"] = repeat(usage, lambda: allreduce(small), args.small_ops)
    barrier()
    report["large"] = repeat(usage, lambda: allreduce(large), args.large_ops, sample_cpu=True, bytes=large.numel() * 4)
    barrier()
    report["ours"] = scheduled_cost(make_optimizer)
    barrier()
    report["hooks"] = hook_costs(wrap)
    if args.backend == "horovod":
        handle = hvd.allreduce_async(small, name="bytescheduler.calibrate.poll")
        report["poll_cpu"] = poll_cost(lambda: hvd.poll(handle))
        hvd.synchronize(handle)
    barrier()
    with open(args.output.replace("{rank}", str(rank)), "w") as out:
        json.dump(report, out, indent=1)
    gc.collect()  # free the optimizer's groups before the process group ends (see bench/worker.py)
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
