"""One rank of a benchmark job: every system trains its own copy of the model, in turns.

Run by :mod:`bytescheduler.bench.runner`, never by hand. Each round runs every system for
a timed block of iterations, one after another, so slow drift of the machine affects all
systems alike; a barrier starts each block and the system's flush (waiting for pending
communication) ends it inside the timed block.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from datetime import timedelta
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..models import build


def _rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Tracer:
    """Compute spans (forward, backward, step) of the traced iteration, as Chrome trace events."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: List[dict] = []
        self.active = False
        self._offset = time.time() - time.perf_counter()

    def span(self, system: str, name: str, start: float, end: float) -> None:
        if self.active:
            self.events.append({"name": name, "cat": f"compute:{system}", "ph": "X", "pid": self.rank, "tid": 1,
                                "ts": round((start + self._offset) * 1e6, 3), "dur": round((end - start) * 1e6, 3)})


class System:
    """A way to train: ``iterate`` runs one training iteration, ``flush`` waits for its communication."""

    def __init__(self, name: str, model: torch.nn.Module, optimizer, make_batch, batch_size: int, rank: int,
                 tracer: _Tracer) -> None:
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

    def flush(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


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
    def flush(self) -> None:
        self.optimizer.synchronize()

    def stats(self) -> dict:
        return self.optimizer._bytescheduler.scheduler.stats

    def close(self) -> None:
        self.optimizer.close()


class HookedDDP(System):
    def __init__(self, *args, state=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = state

    def stats(self) -> dict:
        return self.state.scheduler.stats

    def close(self) -> None:
        self.state.close()


def _make_systems(args, rank: int, tracer: _Tracer) -> Dict[str, System]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    def fresh():
        torch.manual_seed(0)
        model, make_batch = build(args.model)
        return model, make_batch

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    options = dict(partition_bytes=args.partition, credit_bytes=args.credit)
    systems: Dict[str, System] = {}
    common = dict(batch_size=args.batch_size, rank=rank, tracer=tracer)
    for name in args.systems:
        model, make_batch = fresh()
        timeline = os.path.join(args.trace_dir, f"{name}.json") if args.trace_dir else None
        if name == "compute":
            systems[name] = System(name, model, sgd(model), make_batch, **common)
        elif name == "comm":
            systems[name] = CommunicationOnly(name, model, sgd(model), make_batch, **common)
        elif name == "ddp":
            ddp = DDP(model)
            systems[name] = System(name, ddp, sgd(ddp), make_batch, **common)
        elif name == "ddp-hook":
            ddp = DDP(model)
            state = bsp.ScheduledHookState(timeline=timeline, **options)
            ddp.register_comm_hook(state, bsp.scheduled_allreduce_hook)
            systems[name] = HookedDDP(name, ddp, sgd(ddp), make_batch, state=state, **common)
        elif name == "scheduled":
            optimizer = bsp.ScheduledOptimizer(model, sgd(model), timeline=timeline, **options)
            systems[name] = Scheduled(name, model, optimizer, make_batch, **common)
        else:
            raise ValueError(f"unknown system {name!r}")
    return systems


def _link_rate(megabytes: int = 32, repeats: int = 3) -> float:
    """Measured bytes per second each rank sends in a ring all-reduce of a large tensor."""
    world = dist.get_world_size()
    tensor = torch.zeros(megabytes * 2**20 // 4)
    dist.all_reduce(tensor)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return 2 * (world - 1) / world * tensor.numel() * 4 / min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--systems", nargs="+", required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--partition", default=None)
    parser.add_argument("--credit", default=None)
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    rank = args.rank
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank,
                            world_size=args.world_size, timeout=timedelta(seconds=600))
    tracer = _Tracer(rank)
    systems = _make_systems(args, rank, tracer)
    link = _link_rate()
    gradient_bytes = sum(p.numel() * p.element_size() for p in next(iter(systems.values())).model.parameters())
    for system in systems.values():
        for _ in range(args.warmup):
            system.iterate()
        system.flush()
    times: Dict[str, List[float]] = {name: [] for name in systems}
    rss: Dict[str, float] = {name: 0.0 for name in systems}
    _progress(rank, 0, args.rounds)
    for round_index in range(args.rounds):
        for name, system in systems.items():
            tracer.active = round_index == args.rounds - 1
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                system.iterate()
            system.flush()
            times[name].append((time.perf_counter() - start) / args.iters)
            tracer.active = False
            rss[name] = max(rss[name], _rss_mib())
        _progress(rank, round_index + 1, args.rounds)
    result = {
        "rank": rank,
        "times": times,
        "rss_mib": rss,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "link_bytes_per_s": link,
        "gradient_bytes": gradient_bytes,
        "stats": {name: system.stats() for name, system in systems.items()},
        "compute_events": tracer.events,
    }
    for system in systems.values():
        system.close()
    with open(args.output, "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()
    return 0


def _progress(rank: int, done: int, total: int) -> None:
    if rank == 0:
        print(f"PROGRESS {done}/{total}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
