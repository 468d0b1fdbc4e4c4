"""The torch adapters on one GPU (or, with ``--cpu``, the same checks on CPU tensors).

    python scripts/gpu_check.py OUT [--cpu]          (scripts/gpu_check.sh runs it)

Every check trains one model with the framework's own path and one with ours, from the same
weights and batches, and compares the parameters bit for bit:

- world size 1 over NCCL (``--cpu``: gloo): ScheduledOptimizer on the scheduled path and on
  the plain path against DDP, the DDP hook against DDP;
- 2 ranks on the one device over gloo (NCCL refuses two ranks on one GPU), the same three;
- streams (GPU only): the forward and backward on a side stream; a ``non_blocking`` copy of
  each batch to the device; the timeline (Chrome trace) written and readable;
- ``torch.compile`` of the model under each adapter, once (equal to the compiled DDP run
  within 1e-6: compiled kernels may fuse differently);
- what scheduling costs where communication is free: seconds per step of DDP and of
  ScheduledOptimizer's scheduled path at world size 1 on a small and a large model.

Writes ``OUT/table.md`` and ``OUT/results.json``, prints the table, and exits 1 if any check
differs or fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import bytescheduler.pytorch as bsp
from bytescheduler.core.timeline import timeline_path

STEPS = 6
SMALL_OPTIONS = dict(partition_bytes=4096, credit_bytes=16384)  # every gradient cut into pieces


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def large_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 10))


def batch(rank: int, step: int, device: torch.device, non_blocking: bool = False):
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 3, 8, 8, generator=generator)
    y = torch.randint(0, 10, (16,), generator=generator)
    if non_blocking and device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def train(model: nn.Module, forward: nn.Module, optimizer: torch.optim.Optimizer, rank: int, device: torch.device,
          stream: Optional[Any] = None, non_blocking: bool = False) -> None:
    for step in range(STEPS):
        optimizer.zero_grad()
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            x, y = batch(rank, step, device, non_blocking)
            F.cross_entropy(forward(x), y).backward()
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        optimizer.step()


def difference(ours: nn.Module, theirs: nn.Module, tolerance: float = 0.0) -> Optional[str]:
    """None when the parameters agree (bitwise, or within ``tolerance`` relative), else which differs."""
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        a, b = a.detach().cpu(), b.detach().cpu()
        if tolerance == 0.0 and not torch.equal(a, b):
            return f"{name} differs by {(a - b).abs().max().item():.3g}"
        if tolerance and not torch.allclose(a, b, rtol=0, atol=tolerance * max(b.abs().max().item(), 1e-12)):
            return f"{name} differs by {(a - b).abs().max().item():.3g}"
    return None


def ddp(model: nn.Module, device: torch.device) -> DDP:
    """``model`` under DDP on ``device`` (one device per process)."""
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def ddp_run(device: torch.device, rank: int, compile_model: bool = False, **train_args: Any) -> nn.Module:
    model = small_model().to(device)
    forward = ddp(model, device)
    run = torch.compile(forward) if compile_model else forward
    train(model, run, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), rank, device, **train_args)
    return model


def optimizer_run(device: torch.device, rank: int, compile_model: bool = False, **options: Any) -> nn.Module:
    train_args = {key: options.pop(key) for key in ("stream", "non_blocking") if key in options}
    model = small_model().to(device)
    optimizer = bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), timeout=60,
                                       **options)
    try:
        train(model, torch.compile(model) if compile_model else model, optimizer, rank, device, **train_args)
        optimizer.synchronize()
    finally:
        optimizer.close()
    return model


def hook_run(device: torch.device, rank: int, compile_model: bool = False, **options: Any) -> nn.Module:
    model = small_model().to(device)
    forward = ddp(model, device)
    state = bsp.ScheduledHookState(model=forward, timeout=60, **options)
    forward.register_comm_hook(state, bsp.scheduled_allreduce_hook)
    try:
        train(model, torch.compile(forward) if compile_model else forward,
              torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), rank, device)
    finally:
        state.close()
    return model


def checks(device: torch.device, rank: int, world: int, out: str) -> List[Dict[str, Any]]:
    """Every equality check at this world size; one row each."""
    rows = []
    where = f"{world} rank{'s' if world > 1 else ''}, {dist.get_backend()}, {device.type}"

    def check(name: str, ours: Callable[[], nn.Module], theirs: Callable[[], nn.Module], tolerance: float = 0.0):
        started = time.perf_counter()
        try:
            found = difference(ours(), theirs(), tolerance)
            row = {"check": name, "where": where, "ok": found is None, "detail": found or
                   ("bit for bit" if tolerance == 0.0 else f"within {tolerance:g}")}
        except Exception as error:  # noqa: BLE001 - every failure is a row of the table
            row = {"check": name, "where": where, "ok": False, "detail": f"{type(error).__name__}: {error}",
                   "traceback": traceback.format_exc()}
        row["seconds"] = round(time.perf_counter() - started, 1)
        rows.append(row)

    baseline = lambda: ddp_run(device, rank)  # noqa: E731
    check("ScheduledOptimizer, scheduled path", lambda: optimizer_run(device, rank, adaptive=False, **SMALL_OPTIONS),
          baseline)
    check("ScheduledOptimizer, plain path", lambda: optimizer_run(device, rank, adaptive=True, start_plain=True),
          baseline)
    check("DDP hook, scheduled", lambda: hook_run(device, rank, adaptive=False, **SMALL_OPTIONS), baseline)
    check("DDP hook, DDP's own path", lambda: hook_run(device, rank, adaptive=True, start_plain=True), baseline)
    trace = os.path.join(out, f"timeline-w{world}.json")
    check("timeline written", lambda: _with_timeline(device, rank, trace), baseline)
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        check("ScheduledOptimizer, backward on a side stream",
              lambda: optimizer_run(device, rank, adaptive=False, stream=stream, **SMALL_OPTIONS),
              lambda: ddp_run(device, rank, stream=stream))
        check("ScheduledOptimizer, non_blocking copies of the batch",
              lambda: optimizer_run(device, rank, adaptive=False, non_blocking=True, **SMALL_OPTIONS),
              lambda: ddp_run(device, rank, non_blocking=True))
    if world == 1:
        compiled = lambda: ddp_run(device, rank, compile_model=True)  # noqa: E731
        check("torch.compile, ScheduledOptimizer", lambda: optimizer_run(device, rank, compile_model=True,
                                                                         adaptive=False), compiled, 1e-6)
        check("torch.compile, DDP hook", lambda: hook_run(device, rank, compile_model=True, adaptive=False),
              compiled, 1e-6)
    return rows


def _with_timeline(device: torch.device, rank: int, path: str) -> nn.Module:
    model = optimizer_run(device, rank, adaptive=False, timeline=path, **SMALL_OPTIONS)
    written = timeline_path(path, rank)
    with open(written) as handle:
        events = json.load(handle)
    events = events["traceEvents"] if isinstance(events, dict) else events
    if not events:
        raise AssertionError(f"the timeline {written} holds no events")
    return model


def costs(device: torch.device, warmup: int = 5, timed: int = 25) -> List[Dict[str, Any]]:
    """Seconds per step of DDP and of ScheduledOptimizer's scheduled path at world size 1, where
    there is nothing to communicate: what scheduling costs (the mode switch would run DDP's
    path there). Steps run back to back, as in training, and are timed as a whole."""
    rows = []
    for name, build in (("small", small_model), ("large", large_model)):
        times = {}
        for system in ("DDP", "ScheduledOptimizer"):
            model = build().to(device)
            sgd = torch.optim.SGD(model.parameters(), lr=0.01)
            if system == "DDP":
                forward, optimizer = ddp(model, device), sgd
            else:
                forward, optimizer = model, bsp.ScheduledOptimizer(model, sgd, adaptive=False, timeout=60)
            batches = [batch(0, step, device) for step in range(warmup + timed)]
            for step, (x, y) in enumerate(batches):
                if step == warmup:
                    if system != "DDP":
                        optimizer.synchronize()
                    _sync(device)
                    started = time.perf_counter()
                optimizer.zero_grad()
                F.cross_entropy(forward(x), y).backward()
                optimizer.step()
            if system != "DDP":
                optimizer.synchronize()
            _sync(device)
            times[system] = (time.perf_counter() - started) / timed
            if system != "DDP":
                optimizer.close()
        rows.append({"model": name, "ddp_ms": round(times["DDP"] * 1e3, 3),
                     "scheduled_ms": round(times["ScheduledOptimizer"] * 1e3, 3),
                     "ratio": round(times["ScheduledOptimizer"] / times["DDP"], 3)})
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(args: argparse.Namespace) -> int:
    """One rank of a job (``--rank``): its checks as one JSON line on stdout."""
    device = torch.device("cuda", 0) if not args.cpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if args.cpu or args.world > 1 else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    try:
        result = {"rows": checks(device, args.rank, args.world, args.out)}
        if args.world == 1:
            result["costs"] = costs(device)
    finally:
        dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def job(args: argparse.Namespace, world: int, log: str) -> List[Dict[str, Any]]:
    """Run ``world`` ranks of this script; every rank's result."""
    port = _free_port()
    base = [sys.executable, os.path.abspath(__file__), args.out, "--world", str(world), "--port", str(port)]
    if args.cpu:
        base.append("--cpu")
    with open(log, "w") as handle:
        processes = [subprocess.Popen([*base, "--rank", str(rank)], stdout=subprocess.PIPE, stderr=handle, text=True)
                     for rank in range(world)]
        outputs = []
        for process in processes:
            try:
                outputs.append(process.communicate(timeout=args.deadline)[0])
            except subprocess.TimeoutExpired:
                for other in processes:
                    other.kill()
                raise SystemExit(f"gpu_check: the {world}-rank job passed its deadline ({args.deadline} s); see {log}")
    results = []
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        if process.returncode != 0 or not lines:
            raise SystemExit(f"gpu_check: rank {rank} of the {world}-rank job failed (exit {process.returncode}); "
                             f"see {log}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--cpu", action="store_true", help="the same checks on CPU tensors (gloo)")
    parser.add_argument("--deadline", type=float, default=240, help="seconds each job may take")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(args)
    os.makedirs(args.out, exist_ok=True)
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run with --cpu for the dry run")
    device_name = torch.cuda.get_device_name(0) if not args.cpu else "CPU (dry run)"
    started = time.monotonic()
    single = job(args, 1, os.path.join(args.out, "world1.log"))[0]
    pair = job(args, 2, os.path.join(args.out, "world2.log"))
    rows = single["rows"] + [dict(row, where=f"{row['where']}, rank {rank}") for rank, result in enumerate(pair)
                             for row in result["rows"]]
    table = [f"gpu_check on {device_name}, torch {torch.__version__}"
             f"{', CUDA ' + torch.version.cuda if torch.version.cuda and not args.cpu else ''}, "
             f"{time.monotonic() - started:.0f} s", "",
             "| check | where | result | detail | s |", "|---|---|---|---|---|"]
    table += [f"| {r['check']} | {r['where']} | {'ok' if r['ok'] else 'DIFFERS'} | {r['detail']} | {r['seconds']} |"
              for r in rows]
    table += ["", "| model | DDP ms/step | ScheduledOptimizer ms/step | ratio |", "|---|---|---|---|"]
    table += [f"| {c['model']} | {c['ddp_ms']} | {c['scheduled_ms']} | {c['ratio']} |" for c in single["costs"]]
    text = "\n".join(table)
    print(text)
    with open(os.path.join(args.out, "table.md"), "w") as handle:
        handle.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump({"device": device_name, "rows": rows, "costs": single["costs"],
                   "bytescheduler": os.path.dirname(os.path.abspath(bsp.__file__))}, handle, indent=1)
    failed = [r for r in rows if not r["ok"]]
    for row in failed:
        print(f"\n--- {row['check']} ({row['where']}):\n{row.get('traceback', row['detail'])}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
