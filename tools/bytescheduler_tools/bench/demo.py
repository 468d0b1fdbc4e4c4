"""A 2-rank demo on 127.0.0.1: DDP's default all-reduce against DDP with the scheduled hook.

    bytescheduler demo                 # 2 local ranks, gloo, a small VGG-like CNN
    bytescheduler demo --iters 10 --rounds 6

Both systems train the same model on the same synthetic data, alternating in rounds so
that drift on the machine affects both alike; the table shows the median time per
iteration over all rounds. On loopback communication is cheap, so expect a ratio near 1:
the scheduler wins on slow networks (see docs/), and must cost nothing here.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from datetime import timedelta
from typing import Dict, List

from .local_ranks import run_local_ranks


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, results) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        from .models import build

        torch.manual_seed(0)
        plain = DDP(build("vgg-small")[0])
        torch.manual_seed(0)
        scheduled = DDP(build("vgg-small")[0])
        state = bsp.ScheduledHookState(partition_bytes=args.partition, credit_bytes=args.credit)
        scheduled.register_comm_hook(state, bsp.scheduled_allreduce_hook)
        systems = {"DDP default": plain, "DDP + scheduled hook": scheduled}
        optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for name, m in systems.items()}
        data = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch_size, 3, 32, 32, generator=data)
        y = torch.randint(0, 10, (args.batch_size,), generator=data)

        def iterate(name: str) -> None:
            optimizers[name].zero_grad()
            torch.nn.functional.cross_entropy(systems[name](x), y).backward()
            optimizers[name].step()

        for name in systems:  # warm-up: DDP rebuilds its buckets after the first step
            for _ in range(args.warmup):
                iterate(name)
        times: Dict[str, List[float]] = {name: [] for name in systems}
        for _ in range(args.rounds):
            for name in systems:
                dist.barrier()
                started = time.perf_counter()
                for _ in range(args.iters):
                    iterate(name)
                times[name].append((time.perf_counter() - started) / args.iters)
        state.close()
        same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), scheduled.parameters()))
        results.put((rank, (times, same, state.scheduler.stats), None))
        # Free the DDP models (they hold the process group) before ending it, so gloo's
        # threads end with the group instead of outliving the interpreter (an abort at
        # exit otherwise). DDP's hooks refer to the module: only the collector frees it.
        systems.clear()
        optimizers.clear()
        del plain, scheduled
        gc.collect()
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001
        import traceback

        results.put((rank, None, traceback.format_exc()))
        raise SystemExit(1) from error


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(prog="bytescheduler demo", description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up iterations per system")
    parser.add_argument("--iters", type=int, default=5, help="iterations per timed block")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--partition", default="4MiB", help="partition size (e.g. 4MiB)")
    parser.add_argument("--credit", default="16MiB", help="credit size (e.g. 16MiB)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the demo gives up")
    args = parser.parse_args(argv)

    world_size = 2
    print(f"bytescheduler demo: {world_size} ranks on 127.0.0.1 (gloo), VGG-like CNN, "
          f"batch {args.batch_size}, {args.rounds} rounds x {args.iters} iterations per system", flush=True)
    collected = run_local_ranks(_rank_main, (args,), world_size, args.timeout, "demo")
    if collected is None:
        return 1

    times, same, stats = collected[0]
    # An iteration ends when the slowest rank is done: take the max over ranks per block.
    blocks = {name: [max(collected[r][0][name][i] for r in collected) for i in range(args.rounds)]
              for name in times}
    baseline = statistics.median(blocks["DDP default"])
    print()
    print("| system | median s/iter | min | max | samples/s (2 ranks) | speedup |")
    print("|---|---|---|---|---|---|")
    for name, values in blocks.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.4f} | {min(values):.4f} | {max(values):.4f} | "
              f"{world_size * args.batch_size / median:.1f} | {baseline / median:.3f}x |")
    print()
    print(f"parameters identical after training: {all(collected[r][1] for r in collected)}")
    print(f"scheduler on rank 0: {stats['operations']} operations, {stats['pieces']} pieces, "
          f"peak {stats['peak_in_flight_bytes'] / 2**20:.1f} MiB in flight")
    print("on loopback communication is cheap, so the two should be close; see docs/ for slow networks")
    return 0 if all(collected[r][1] for r in collected) else 2


if __name__ == "__main__":
    raise SystemExit(main())
