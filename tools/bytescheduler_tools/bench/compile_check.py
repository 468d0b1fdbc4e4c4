"""torch.compile with each adapter on 2 local ranks: time per step, recompiles, graph breaks, numbers.

    bytescheduler compile-check                          # mlp-small and gpt2-small, every system
    bytescheduler compile-check --models mlp-small --rounds 12 --out compile.json

Every system trains the same model from the same weights on the same batches (gloo on
127.0.0.1, one core per rank). Each is built and warmed up in turn (``--warmup`` steps,
enough for dynamo to compile every path the mode switch tries); then the systems take turns
in ``--rounds`` blocks of ``--iters`` steps, in a rotating order, and the table shows the
median time per step (the slower rank's per block) and its ratio to compiled DDP.

Systems (``--systems``):

- ``ddp``, ``ddp-compiled``: DDP, eager and ``torch.compile(DDP(model))``;
- ``allreduce-compiled``: ``torch.compile(model)``, gradients averaged by one
  ``all_reduce`` each after backward, then the plain optimizer: the unscheduled path on
  the very graph the scheduled systems compile, so their reference, bit for bit (compiled
  DDP's graph is not the same: its numbers differ from these by rounding);
- ``scheduled``, ``scheduled-compiled``: ScheduledOptimizer, eager and on
  ``torch.compile(model)``;
- ``hook-compiled``: ``torch.compile(DDP(model))`` with the scheduled hook (against
  ``ddp-compiled``, bit for bit).

"recompiles" counts each system's dynamo compilations in its timed blocks (0: none after
the warm-up); "breaks" the graph breaks dynamo reported while it warmed up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional

from .local_ranks import run_local_ranks

SYSTEMS = ("ddp", "ddp-compiled", "allreduce-compiled", "scheduled", "scheduled-compiled", "hook-compiled")
REFERENCE = {"scheduled-compiled": "allreduce-compiled", "hook-compiled": "ddp-compiled", "scheduled": "ddp",
             "ddp-compiled": "ddp", "allreduce-compiled": "ddp"}


class Trained:
    """One system: a model, how it is called, its optimizer, and its own batches."""

    def __init__(self, model, net, optimizer, make_batch, rank: int, batch_size: int,
                 after_backward: Optional[Callable[[], None]] = None, close: Optional[Callable[[], None]] = None):
        import torch

        self.model, self.net, self.optimizer = model, net, optimizer
        self._make_batch, self._batch_size = make_batch, batch_size
        self._generator = torch.Generator().manual_seed(1000 + rank)
        self._after_backward = after_backward
        self._close = close
        self.losses: List[float] = []

    def step(self) -> None:
        import torch.nn.functional as F

        x, y = self._make_batch(self._batch_size, self._generator)
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.net(x), y)
        loss.backward()
        if self._after_backward is not None:
            self._after_backward()
        self.optimizer.step()
        self.losses.append(loss.detach())

    def finish(self) -> List:
        """Close the system; its parameters, current."""
        if self._close is not None:
            self._close()
        return [p.detach().clone() for p in self.model.parameters()]


def compile_parts(model) -> None:
    """Compile, in place (``Module.compile()``), the model's own blocks: each module in a
    ``ModuleList`` or ``ModuleDict`` and each child of a class defined outside torch.

    torch's own modules are left alone: dynamo skips their code when it is called from
    eager code, so ``nn.LayerNorm(...).compile()`` runs eagerly, except under a torch
    function mode such as ScheduledOptimizer's read guard, where it compiles (and rounds
    differently)."""
    import torch

    for child in model.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for block in child.children():
                block.compile()
        elif not type(child).__module__.startswith("torch.") and any(True for _ in child.parameters()):
            child.compile()


def build_system(name: str, model_name: str, rank: int, world_size: int, batch_size: int,
                 lr: float = 0.05, optimizer_class: Optional[type] = None, **options) -> Trained:
    """``name`` on a fresh ``model_name`` (bench/models.py) seeded 0: one of :data:`SYSTEMS`,
    or an adapter (ddp, allreduce, scheduled, hook) alone (eager) or with ``-parts`` (its
    children compiled, :func:`compile_parts`); ``optimizer_class``: SGD's or a subclass
    (momentum 0.9); ``options`` go to the scheduled adapters."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytescheduler.pytorch as bsp

    from .models import build

    adapter, _, compiled = name.partition("-")
    if adapter not in ("ddp", "allreduce", "scheduled", "hook") or compiled not in ("", "compiled", "parts"):
        raise ValueError(f"unknown system {name!r}: use one of {', '.join(SYSTEMS)}")
    torch.manual_seed(0)
    model, make_batch = build(model_name)
    optimizer = (optimizer_class or torch.optim.SGD)(model.parameters(), lr=lr, momentum=0.9)
    after_backward = close = None
    if compiled == "parts":
        compile_parts(model)
    if adapter in ("ddp", "hook"):
        net = DDP(model)
        if adapter == "hook":
            state = bsp.ScheduledHookState(**options)
            net.register_comm_hook(state, bsp.scheduled_allreduce_hook)
            close = state.close
    elif adapter == "allreduce":
        net = model

        def after_backward() -> None:
            for param in model.parameters():
                param.grad.div_(world_size)
                dist.all_reduce(param.grad)
    else:
        net = model
        optimizer = bsp.ScheduledOptimizer(model, optimizer, **options)
        close = optimizer.close
    if compiled == "compiled":
        net = torch.compile(net)
    return Trained(model, net, optimizer, make_batch, rank, batch_size, after_backward, close)


class CompileCounter:
    """Dynamo's compilations and graph breaks in this process, so far."""

    def __init__(self) -> None:
        import torch._dynamo

        self.compiles = 0
        torch._dynamo.callback_handler.register_start_callback(self._started)

    def _started(self, args=None) -> None:
        if getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO") == "DYNAMO":
            self.compiles += 1

    @staticmethod
    def graph_breaks() -> int:
        from torch._dynamo.utils import counters

        return sum(counters["graph_break"].values())


def run_rank(rank: int, world_size: int, port: int, args: argparse.Namespace, model_name: str) -> dict:
    """One rank's measurements of every system on ``model_name``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                           timeout=timedelta(seconds=args.timeout))
    counter = CompileCounter()
    systems: Dict[str, Trained] = {}
    result: dict = {"warmup_s": {}, "graph_breaks": {}, "compiles_warmup": {}}
    try:
        for name in args.systems:
            breaks, compiles = counter.graph_breaks(), counter.compiles
            dist.barrier()
            started = time.perf_counter()
            systems[name] = build_system(name, model_name, rank, world_size, args.batch_size)
            for _ in range(args.warmup):
                systems[name].step()
            dist.barrier()
            result["warmup_s"][name] = time.perf_counter() - started
            result["graph_breaks"][name] = counter.graph_breaks() - breaks
            result["compiles_warmup"][name] = counter.compiles - compiles
        times: Dict[str, List[float]] = {name: [] for name in systems}
        result["compiles_after_warmup"] = after = {name: 0 for name in systems}
        names = list(systems)
        for block in range(args.rounds):
            for name in names[block % len(names):] + names[:block % len(names)]:
                dist.barrier()
                before = counter.compiles
                started = time.perf_counter()
                for _ in range(args.iters):
                    systems[name].step()
                times[name].append((time.perf_counter() - started) / args.iters)
                after[name] += counter.compiles - before
        result["times"] = times
        result["params"] = {name: system.finish() for name, system in systems.items()}
        result["losses"] = {name: torch.stack(system.losses) for name, system in systems.items()}
    finally:
        systems.clear()
        import gc

        gc.collect()
        dist.destroy_process_group()
    return result


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, model_name: str, results) -> None:
    import io

    import torch

    try:
        buffer = io.BytesIO()  # bytes, not tensors: a tensor in a queue needs its sender alive
        torch.save(run_rank(rank, world_size, port, args, model_name), buffer)
        results.put((rank, buffer.getvalue(), None))
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        import traceback

        results.put((rank, None, traceback.format_exc()))
        raise SystemExit(1) from error


def max_relative(ours: List, theirs: List) -> float:
    """The largest ``|a - b| / max|b|`` over the parameters."""
    return max(float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
               for a, b in zip(ours, theirs))


def summarize(ranks: Dict[int, dict], args: argparse.Namespace) -> List[dict]:
    import torch

    zero = ranks[0]
    rows = []
    blocks = {name: [max(ranks[r]["times"][name][i] for r in ranks) for i in range(args.rounds)]
              for name in zero["times"]}
    ddp_compiled = statistics.median(blocks["ddp-compiled"]) if "ddp-compiled" in blocks else None
    for name in zero["times"]:
        median = statistics.median(blocks[name])
        reference = REFERENCE.get(name)
        row = {"system": name, "ms_per_step": 1000 * median,
               "vs_ddp_compiled": median / ddp_compiled if ddp_compiled else None,
               "warmup_s": max(ranks[r]["warmup_s"][name] for r in ranks),
               "graph_breaks": zero["graph_breaks"][name], "compiles_warmup": zero["compiles_warmup"][name],
               "compiles_after_warmup": max(ranks[r]["compiles_after_warmup"][name] for r in ranks),
               "reference": reference if reference in zero["params"] else None}
        if row["reference"]:
            row["bitwise"] = all(
                all(torch.equal(a, b) for a, b in zip(ranks[r]["params"][name], ranks[r]["params"][reference]))
                and torch.equal(ranks[r]["losses"][name], ranks[r]["losses"][reference]) for r in ranks)
            row["max_relative"] = max(max_relative(ranks[r]["params"][name], ranks[r]["params"][reference])
                                      for r in ranks)
        if "ddp-compiled" in zero["params"]:
            row["max_relative_vs_ddp_compiled"] = max(
                max_relative(ranks[r]["params"][name], ranks[r]["params"]["ddp-compiled"]) for r in ranks)
        rows.append(row)
    return rows


def table(model_name: str, rows: List[dict]) -> str:
    lines = [f"{model_name}:",
             f"{'system':<20} {'ms/step':>8} {'x ddp-compiled':>15} {'warm-up s':>10} {'breaks':>7} {'recompiles':>10}"
             f" {'same as':>22} {'max rel':>9} {'vs ddp-compiled':>16}"]
    for row in rows:
        ratio = "" if row["vs_ddp_compiled"] is None else f"{row['vs_ddp_compiled']:.3f}"
        same = "" if not row["reference"] else f"{'=' if row['bitwise'] else '~'} {row['reference']}"
        rel = "" if not row["reference"] else f"{row['max_relative']:.1e}"
        vs = "" if "max_relative_vs_ddp_compiled" not in row else f"{row['max_relative_vs_ddp_compiled']:.1e}"
        lines.append(f"{row['system']:<20} {row['ms_per_step']:>8.2f} {ratio:>15} {row['warmup_s']:>10.1f}"
                     f" {row['graph_breaks']:>7} {row['compiles_after_warmup']:>10} {same:>22} {rel:>9} {vs:>16}")
    lines.append("breaks: graph breaks dynamo reported in the warm-up; recompiles: compilations in the timed"
                 " blocks; same as: '=' bitwise (parameters and losses on every rank), '~' not; max rel: the"
                 " largest |difference| / max|parameter| against it")
    return "\n".join(lines)


def run_model(model_name: str, args: argparse.Namespace) -> Optional[Dict[int, dict]]:
    import io

    import torch

    ranks = run_local_ranks(_rank_main, (args, model_name), 2, args.timeout, f"compile-check: {model_name}")
    if ranks is None:
        return None
    return {rank: torch.load(io.BytesIO(payload), weights_only=False) for rank, payload in ranks.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bytescheduler compile-check", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp-small,gpt2-small", help="comma-separated bench models")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of: " + ", ".join(SYSTEMS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=30, help="steps per system before timing (compiles)")
    parser.add_argument("--iters", type=int, default=10, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=8, help="blocks per system, alternating")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per model before giving up")
    parser.add_argument("--out", help="write the rows as JSON here")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        print(f"compile-check: unknown system(s) {unknown}: use {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    report = {}
    for model_name in args.models.split(","):
        print(f"compile-check: {model_name}: 2 ranks, gloo on 127.0.0.1, batch {args.batch_size}, "
              f"{args.warmup} warm-up steps, {args.rounds} x {args.iters} timed steps per system", flush=True)
        ranks = run_model(model_name, args)
        if ranks is None:
            return 1
        rows = summarize(ranks, args)
        print(table(model_name, rows), flush=True)
        report[model_name] = {"rows": rows}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "models": report}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
