"""Synthetic-data benchmark of PyTorch DDP with bytescheduler's communication hook.

    torchrun --nproc_per_node 2 examples/pytorch_ddp_hook.py --model vgg
    torchrun --nproc_per_node 2 examples/pytorch_ddp_hook.py --model vgg --no-bytescheduler

Runs on CPU with gloo (or on GPUs with NCCL when CUDA is available; untested by us).
Prints the median time per iteration over blocks of iterations, and samples per second.
"""

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bytescheduler.pytorch as bsp
from synthetic import MODELS, build  # examples/synthetic.py: torch only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg", choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5, help="iterations per timed block")
    parser.add_argument("--num-iters", type=int, default=5, help="timed blocks")
    parser.add_argument("--partition", default=None, help="partition size, e.g. 4MiB")
    parser.add_argument("--credit", default=None, help="credit size, e.g. 16MiB")
    parser.add_argument("--no-bytescheduler", action="store_true", help="DDP's default all-reduce")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    median = train(args, device, rank)
    if rank == 0:
        system = "DDP default" if args.no_bytescheduler else "DDP + bytescheduler hook"
        print(f"{system}: model {args.model}, {dist.get_world_size()} ranks, "
              f"median {median:.4f} s/iter, {args.batch_size * dist.get_world_size() / median:.1f} samples/s")
    # DDP holds the process group; free it first, so gloo's threads end with the group instead
    # of outliving the interpreter ("terminate called without an active exception" at exit,
    # in 1 of 4 runs of plain DDP here). DDP's hooks refer to the module, a reference cycle
    # that only the garbage collector frees.
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device, rank: int) -> float:
    """Train DDP (with or without the scheduled hook); return the median seconds per iteration."""
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    network, make_batch = build(args.model)
    model = DDP(network.to(device))
    state = None
    if not args.no_bytescheduler:
        state = bsp.ScheduledHookState(partition_bytes=args.partition, credit_bytes=args.credit)
        model.register_comm_hook(state, bsp.scheduled_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = make_batch(args.batch_size, torch.Generator().manual_seed(rank))
    x, y = x.to(device), y.to(device)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(args.num_warmup_batches):
        step()
    blocks = []
    for _ in range(args.num_iters):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        if cuda:
            torch.cuda.synchronize()
        blocks.append((time.perf_counter() - started) / args.num_batches_per_iter)
    if state is not None:
        state.close()
    return statistics.median(blocks)


if __name__ == "__main__":
    main()
