"""Synthetic-data benchmark of Horovod with bytescheduler's ScheduledOptimizer (the original API).

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_horovod_benchmark.py --model vgg
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_horovod_benchmark.py --model vgg --no-bytescheduler

As in ByteScheduler's own benchmark, the script is a Horovod script plus two lines:
``bsc.init()`` and ``optimizer = bsc.ScheduledOptimizer(model, optimizer)``.
Horovod moves the bytes; bytescheduler decides which gradient pieces go when and applies
each parameter's update as soon as it is averaged. The baseline is
``hvd.DistributedOptimizer`` alone. Runs on CPU (or on GPUs when CUDA is available;
untested by us). Prints the median time per iteration over blocks of iterations, and
samples per second.
"""

import argparse
import statistics
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

import bytescheduler.pytorch.horovod as bsc
from synthetic import MODELS, build  # examples/synthetic.py: torch only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg", choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5, help="iterations per timed block")
    parser.add_argument("--num-iters", type=int, default=5, help="timed blocks")
    parser.add_argument("--partition", default=None, help="partition size, e.g. 4MiB")
    parser.add_argument("--no-bytescheduler", action="store_true", help="hvd.DistributedOptimizer alone")
    args = parser.parse_args()

    hvd.init()
    if not args.no_bytescheduler:
        bsc.init()
    rank, world_size = hvd.rank(), hvd.size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    torch.manual_seed(0)
    model, make_batch = build(args.model)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    if not args.no_bytescheduler:
        optimizer = bsc.ScheduledOptimizer(model, optimizer, partition_bytes=args.partition)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
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
        hvd.barrier()
        started = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        finish()
        blocks.append((time.perf_counter() - started) / args.num_batches_per_iter)
    if not args.no_bytescheduler:
        optimizer.close()
    median = statistics.median(blocks)
    if rank == 0:
        system = "Horovod DistributedOptimizer" if args.no_bytescheduler else "Horovod + bytescheduler"
        print(f"system: {system}")
        print(f"{system}: model {args.model}, {world_size} ranks, batch {args.batch_size} per rank, "
              f"median {median:.4f} s/iter, {args.batch_size * world_size / median:.1f} samples/s")
    hvd.shutdown()


if __name__ == "__main__":
    main()
