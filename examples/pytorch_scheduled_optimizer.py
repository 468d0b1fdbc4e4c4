"""Synthetic-data benchmark of bytescheduler's ScheduledOptimizer (torch.distributed) against DDP.

    torchrun --nproc_per_node 2 examples/pytorch_scheduled_optimizer.py --model vgg
    torchrun --nproc_per_node 2 examples/pytorch_scheduled_optimizer.py --model vgg --no-bytescheduler

The scheduled run trains the plain model: the optimizer averages each gradient and applies
each parameter's update as soon as it arrives, overlapping communication with the next
forward. The baseline is DDP with its default all-reduce. Runs on CPU with gloo (or on GPUs
with NCCL when CUDA is available; untested by us). Prints the median time per iteration
over blocks of iterations, and samples per second.
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
    parser.add_argument("--no-bytescheduler", action="store_true", help="DDP with its default all-reduce")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    median = train(args, device, rank)
    if rank == 0:
        system = "DDP default" if args.no_bytescheduler else "ScheduledOptimizer (bytescheduler)"
        print(f"system: {system}")
        print(f"{system}: model {args.model}, {world_size} ranks, batch {args.batch_size} per rank, "
              f"median {median:.4f} s/iter, {args.batch_size * world_size / median:.1f} samples/s")
    # DDP holds the process group; free it first, so gloo's threads end with the group instead
    # of outliving the interpreter ("terminate called without an active exception" at exit,
    # in 1 of 4 runs of plain DDP here). DDP's hooks refer to the module, a reference cycle
    # that only the garbage collector frees.
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device, rank: int) -> float:
    """Train with ScheduledOptimizer or DDP; return the median seconds per iteration."""
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    network, make_batch = build(args.model)
    network = network.to(device)
    if args.no_bytescheduler:
        model = DDP(network)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        model = network  # no DDP wrapper: the optimizer communicates the gradients itself
        optimizer = bsp.ScheduledOptimizer(
            model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            partition_bytes=args.partition, credit_bytes=args.credit,
        )
    x, y = make_batch(args.batch_size, torch.Generator().manual_seed(rank))
    x, y = x.to(device), y.to(device)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    def finish() -> None:
        """Wait for every update of the steps taken (the scheduled optimizer returns early)."""
        if not args.no_bytescheduler:
            optimizer.synchronize()
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.num_warmup_batches):
        step()
    finish()
    blocks = []
    for _ in range(args.num_iters):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        finish()
        blocks.append((time.perf_counter() - started) / args.num_batches_per_iter)
    if not args.no_bytescheduler:
        optimizer.close()
    return statistics.median(blocks)


if __name__ == "__main__":
    main()
