"""One rank of a Horovod test scenario; run under horovodrun by tests/test_horovod.py.

    horovodrun -np 2 -H localhost:2 --gloo python tests/horovod_worker.py equal

Each rank prints one line ``RESULT {json}`` with what the test asserts (the rank is in it).

Scenarios:

- ``equal``: bytescheduler's ScheduledOptimizer over ``hvd.DistributedOptimizer`` trains
  exactly as ``hvd.DistributedOptimizer`` alone (cnn-small and gpt2-small; SGD with
  momentum and AdamW with a StepLR schedule), side by side in one process.
- ``accumulate``: the same with ``backward_passes_per_step=2``.
- ``idiom``: the same with ``hvd.broadcast_optimizer_state`` and a checkpoint round trip, and
  with a plain torch optimizer (no ``hvd.DistributedOptimizer``) under the scheduler.
- ``credit``: the same under a small credit, with gradients ready in a different order on
  each rank (rank 0 decides the order and sends it by TCP, the others follow).
- ``fallback``: ``credit`` on cnn-small, where rank 1 cannot reach rank 0 by TCP (the order
  then travels by Horovod broadcasts on every rank).
- ``switch``: ``equal``, ``accumulate`` and ``idiom`` cases with the adaptive mode switch
  on and short phases, so both the scheduled and Horovod's own path run, switching often.
- ``two``: two scheduled optimizers in one process (e.g. a GAN), each equal to its baseline.
- ``dies``: rank 1 exits at step 3; rank 0 reports what it saw (if it lives to say it).
- ``stalls``: rank 1 stops training for 12 s on Horovod's own path; rank 0 reports the
  timeout it raised.
- ``bad``: unsupported ``hvd.DistributedOptimizer`` settings raise a clear ValueError, and
  wrapping an already scheduled optimizer again raises TypeError.
- ``surface``: ``hvd.DistributedOptimizer``'s own methods on the scheduled optimizer, each
  beside Horovod's optimizer alone: the clipping idiom (``synchronize()``,
  ``clip_grad_norm_``, ``step()`` inside ``skip_synchronize()``), the warning of a
  ``step()`` right after ``synchronize()``, ``zero_grad()`` refused between backward and
  step, ``load_state_dict()`` between the two, ``op=hvd.Sum`` and
  ``gradient_predivide_factor``, and what is read or set rather than trained.
- ``settings``: rank 1 alone sets bytescheduler's environment variables; both ranks run
  with rank 0's shared settings (rank 1 warns) and the numbers stay Horovod's.
- ``many``: run on 3 to 8 ranks; each step's averaged gradients against Horovod's from the
  same parameters (within 1e-6), with random pauses on every rank and the last rank joining
  late, on small pieces and with the mode switch alternating paths.
- ``layout``: the ranks' models differ (a shape, then the number of parameters); both
  ranks raise ``LayoutMismatch`` naming the parameter.
"""

import argparse
import copy
import json
import os
import sys
import threading
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import bytescheduler.pytorch.horovod as bsc
from bytescheduler_tools.bench.models import build

STEPS = 30
BATCH = 8
PARTITION = "16KiB"  # small, so that the larger gradients are cut into several pieces


def report(**values) -> None:
    values["rank"] = hvd.rank()
    print("RESULT " + json.dumps(values, sort_keys=True), flush=True)


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    raise ValueError(kind)


def make_schedule(kind: str, optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5) if kind == "adamw" else None


def batch(make_batch, step: int, micro: int = 0):
    """Different data on each rank and step, the same for the scheduled run and the baseline."""
    generator = torch.Generator().manual_seed(100_000 * hvd.rank() + 10 * step + micro)
    return make_batch(BATCH, generator)


def fresh_model(name: str):
    torch.manual_seed(1234)
    return build(name)


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def compare(name: str, kind: str, passes: int, idiom: bool = False, plain: bool = False,
            auto_tune: bool = False, steps: int = STEPS, credit=None, skew: bool = False,
            adaptive: bool = False) -> dict:
    """Train a scheduled and a baseline copy of one model side by side; return what differs.

    With ``idiom``, both also do what Horovod scripts (and ByteScheduler's own example) do:
    ``hvd.broadcast_optimizer_state`` after wrapping, and a checkpoint round trip
    (``state_dict``/``load_state_dict``) in the middle of training. With ``plain``, the
    scheduled side wraps the plain torch optimizer (no ``hvd.DistributedOptimizer``).
    """
    baseline_model, make_batch = fresh_model(name)
    scheduled_model, _ = fresh_model(name)
    initial = [p.detach().clone() for p in baseline_model.parameters()]

    baseline = hvd.DistributedOptimizer(
        make_optimizer(kind, baseline_model), named_parameters=baseline_model.named_parameters(),
        backward_passes_per_step=passes,
    )
    hvd.broadcast_parameters(baseline_model.state_dict(), root_rank=0)
    inner = make_optimizer(kind, scheduled_model)
    if not plain:
        inner = hvd.DistributedOptimizer(
            inner, named_parameters=scheduled_model.named_parameters(), backward_passes_per_step=passes,
        )
    scheduled = bsc.ScheduledOptimizer(
        scheduled_model, inner, steps, partition_bytes=PARTITION, credit_bytes=credit, timeout=60,
        backward_passes_per_step=passes if plain else None, auto_tune=auto_tune, adaptive=adaptive,
    )
    if skew and hvd.rank() == 1:
        for index, param in enumerate(scheduled_model.parameters()):
            if index % 2:
                param.register_hook(lambda grad: time.sleep(0.003) or grad)
    user_class = torch.optim.SGD if kind == "sgd" else torch.optim.AdamW
    runs = [
        (baseline_model, baseline, make_schedule(kind, baseline)),
        (scheduled_model, scheduled, make_schedule(kind, scheduled)),
    ]
    if idiom:
        for model, optimizer, _ in runs:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    losses = [[], []]
    hooks = []  # per step: did Horovod's own gradient hooks launch all-reduces in this backward?
    launches = []
    if hasattr(inner, "_allreduce_grad_async"):  # an hvd.DistributedOptimizer: count its launches
        own_launch = inner._allreduce_grad_async
        inner._allreduce_grad_async = lambda p: launches.append(p) or own_launch(p)
    for step in range(steps):
        if idiom and step == steps // 3:
            for _, optimizer, _ in runs:
                optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        for index, (model, optimizer, schedule) in enumerate(runs):
            optimizer.zero_grad()
            for micro in range(passes):
                x, y = batch(make_batch, step, micro)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            if optimizer is scheduled:
                hooks.append("h" if launches else "-")
                launches.clear()
            losses[index].append(loss.item())
            optimizer.step()
            if schedule is not None:
                schedule.step()
    scheduled.synchronize()
    stats = dict(scheduled._bytescheduler.scheduler.stats)
    tuner = scheduled._bytescheduler.scheduler.tuner
    chooser = scheduled._bytescheduler.chooser
    result = {
        "model": name,
        "optimizer": kind,
        "passes": passes,
        "idiom": idiom,
        "plain": plain,
        "max_abs_diff": max_difference(baseline_model, scheduled_model),
        "moved": max((p.detach() - q).abs().max().item() for p, q in zip(scheduled_model.parameters(), initial)),
        "isinstance": isinstance(scheduled, user_class),
        "class_name": type(scheduled).__name__,
        "lr": [baseline.param_groups[0]["lr"], scheduled.param_groups[0]["lr"]],
        "losses_equal": losses[0] == losses[1],
        "checksum": checksum(scheduled_model),
        "tensors": sum(1 for p in scheduled_model.parameters() if p.requires_grad),
        "stats": stats,
        "channel": type(scheduled._bytescheduler.scheduler._channel).__name__,
        "credit_bytes": scheduled._bytescheduler.scheduler.config.credit_bytes,
        "modes": None if chooser is None else "".join(mode[0] for mode in chooser.history),
        "horovod_hooks": "".join(hooks),
        "tuning": None if tuner is None else {
            "done": tuner.done, "settings": [[t.partition_bytes, t.credit_bytes] for t in tuner.history],
        },
    }
    scheduled.close()
    return result


def scenario_equal() -> None:
    runs = [compare(name, kind, 1) for name in ("cnn-small", "gpt2-small") for kind in ("sgd", "adamw")]
    report(scenario="equal", runs=runs)


def scenario_accumulate() -> None:
    report(scenario="accumulate", runs=[compare("cnn-small", "sgd", 2)])


def scenario_idiom() -> None:
    runs = [
        compare("cnn-small", "adamw", 1, idiom=True),
        compare("gpt2-small", "sgd", 1, idiom=True),
        compare("cnn-small", "sgd", 1, plain=True),
        compare("cnn-small", "adamw", 2, plain=True),
    ]
    report(scenario="idiom", runs=runs)


def scenario_switch() -> None:
    """The mode switch with short phases: both paths run, switching often, on every rank alike."""
    from bytescheduler.core import modes

    os.environ["BYTESCHEDULER_MODE_SWITCH"] = modes.ModeSwitchParams(warmup=2, settle=1, trial=2, pairs=2, hold=3, trial_seconds=0, clear_hold=1, min_retrial=2, predict=False).text()
    runs = [
        compare("cnn-small", "sgd", 1, adaptive=True),
        compare("gpt2-small", "adamw", 1, adaptive=True, idiom=True),
        compare("cnn-small", "sgd", 2, adaptive=True),
        compare("cnn-small", "adamw", 1, plain=True, adaptive=True),
    ]
    report(scenario="switch", runs=runs)


def scenario_tune() -> None:
    report(scenario="tune", runs=[compare("cnn-small", "sgd", 1, auto_tune=True, steps=120)])


def scenario_credit() -> None:
    """A credit of 4 pieces while the ranks' gradients become ready in different orders."""
    runs = [compare(name, "sgd", 1, credit="64KiB", skew=True) for name in ("cnn-small", "gpt2-small")]
    report(scenario="credit", runs=runs)


def scenario_fallback() -> None:
    """Rank 1 cannot reach rank 0 by TCP: every rank takes rank 0's order by Horovod broadcasts."""
    from bytescheduler.core.errors import CommunicationError
    from bytescheduler.core.tcp_channel import TcpOrderChannel

    if hvd.rank() == 1:
        def cannot_connect(self, address, token=0, timeout=None):
            raise CommunicationError(f"no route to {address}")
        TcpOrderChannel.join = cannot_connect
    report(scenario="fallback", runs=[compare("cnn-small", "sgd", 1, credit="64KiB", skew=True)])


def scenario_two() -> None:
    """Two scheduled optimizers alive at once (a GAN's generator and discriminator, say).

    Each steps while the other's gradients may still be in flight; both must train exactly
    as two ``hvd.DistributedOptimizer`` alone.
    """
    specs = [("cnn-small", "sgd"), ("tiny", "adamw")]
    runs = []
    for index, (name, kind) in enumerate(specs):
        baseline_model, make_batch = fresh_model(name)
        scheduled_model, _ = fresh_model(name)
        prefix = f"model{index}."  # the baselines' Horovod tensor names must differ between models
        baseline = hvd.DistributedOptimizer(
            make_optimizer(kind, baseline_model),
            named_parameters=[(prefix + n, p) for n, p in baseline_model.named_parameters()],
        )
        scheduled = bsc.ScheduledOptimizer(
            scheduled_model,
            hvd.DistributedOptimizer(
                make_optimizer(kind, scheduled_model),
                named_parameters=[(prefix + n, p) for n, p in scheduled_model.named_parameters()],
            ),
            STEPS, partition_bytes=PARTITION, timeout=30,
        )
        runs.append((name, kind, make_batch, baseline_model, baseline, scheduled_model, scheduled))
    error = None
    try:
        for step in range(STEPS):
            for index, (_, _, make_batch, *pairs) in enumerate(runs):
                for model, optimizer in (pairs[0:2], pairs[2:4]):
                    optimizer.zero_grad()
                    x, y = batch(make_batch, step, index)
                    F.cross_entropy(model(x), y).backward()
                    optimizer.step()
        for run in runs:
            run[-1].synchronize()
    except Exception as caught:  # noqa: BLE001 - the test asserts on what was raised
        error = f"{type(caught).__name__}: {caught}"[:2000]
    for run in runs:  # closed first: a failed optimizer's read guard would raise on reading parameters
        try:
            run[-1].close(wait=error is None)
        except Exception as caught:  # noqa: BLE001
            error = error or f"{type(caught).__name__}: {caught}"[:2000]
    report(
        scenario="two", error=error,
        runs=[{"model": name, "optimizer": kind, "max_abs_diff": max_difference(baseline_model, scheduled_model)}
              for name, kind, _, baseline_model, _, scheduled_model, _ in runs],
    )
    if error is not None:
        sys.exit(4)


def scenario_dies() -> None:
    model, make_batch = fresh_model("cnn-small")
    optimizer = bsc.ScheduledOptimizer(
        model,
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(),
        ),
        1000,
        partition_bytes=PARTITION,
        timeout=8,
    )
    started = None
    step = 0
    try:
        for step in range(1000):
            if step == 3:
                if hvd.rank() == 1:
                    print(f"DYING at {time.time():.3f}", flush=True)
                    os._exit(17)
                started = time.monotonic()
            optimizer.zero_grad()
            x, y = batch(make_batch, step)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        optimizer.synchronize()
    except BaseException as error:  # noqa: BLE001 - the test asserts on what was raised
        report(
            scenario="dies", raised=True, type=type(error).__name__,
            module=type(error).__module__, message=str(error)[:2000], step=step,
            elapsed=None if started is None else time.monotonic() - started,
            at=time.time(),
        )
        optimizer.close(wait=False)
        sys.exit(3)
    report(scenario="dies", raised=False, step=step)


STALL_TIMEOUT = 3.0  # the scheduler's timeout in ``stalls``
STALL_SECONDS = 12.0  # how long rank 1 stops training there


def scenario_stalls() -> None:
    """Rank 1 stops training for a while on Horovod's own path (its process and Horovod alive,
    nothing submitted); rank 0 must raise the timeout after it, not hang in ``synchronize``."""
    model, make_batch = fresh_model("cnn-small")
    optimizer = bsc.ScheduledOptimizer(
        model,
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                 named_parameters=model.named_parameters()),
        1000, start_plain=True, timeout=STALL_TIMEOUT,
    )
    started = None
    step = 0
    try:
        for step in range(6):
            if step == 3:
                if hvd.rank() == 1:
                    time.sleep(STALL_SECONDS)
                    report(scenario="stalls", raised=False, step=step)
                    sys.stdout.flush()
                    os._exit(0)  # the peer is gone for good; rank 0 reported by now
                started = time.monotonic()
            optimizer.zero_grad()
            x, y = batch(make_batch, step)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    except BaseException as error:  # noqa: BLE001 - the test asserts on what was raised
        report(scenario="stalls", raised=True, type=type(error).__name__, message=str(error)[:2000], step=step,
               elapsed=None if started is None else time.monotonic() - started,
               threads=sorted(t.name for t in threading.enumerate() if t.name.startswith("bytescheduler")))
        sys.exit(3)
    report(scenario="stalls", raised=False, step=step)


def scenario_dies_enqueueing() -> None:
    """Rank 1 is SIGKILLed while rank 0's launching thread keeps handing pieces to Horovod,
    as the scheduler's dispatcher does: Horovod's background loop then dies and finalizes
    the queued operations while the thread enqueues more. Rank 0 must learn the failure
    and return (this hung in 5 of 13 tries before horovod_hold.py)."""
    import signal
    import threading

    from bytescheduler.core.task import Operation, Piece, Task
    from bytescheduler.pytorch.horovod import HorovodBackend

    backend = HorovodBackend()
    gradient = torch.zeros(1 << 16)
    failed = threading.Event()
    errors = []
    in_flight = threading.Semaphore(48)

    def done(error) -> None:
        in_flight.release()
        if error is not None and not failed.is_set():
            errors.append(f"{type(error).__name__}: {error}"[:300])
            failed.set()

    def launch_until_refused() -> None:
        # Like a dispatcher in the middle of a batch: it goes on launching after the first
        # failure, until Horovod itself refuses new work (it has shut down).
        number = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            in_flight.acquire()
            task = Task(key=number % 64, numel=gradient.numel(), itemsize=4, priority=0, payload=gradient)
            start = (number % 16) * 4096
            try:
                backend.launch(Operation([Piece(task, start, start + 4096)], lane=0, op_id=number), done)
            except Exception as error:  # noqa: BLE001 - refused: Horovod has shut down
                done(error)
                return
            number += 1

    if hvd.rank() == 1:
        delay = float(os.environ.get("DIES_AFTER", "0.5"))
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    started = time.monotonic()
    launcher = threading.Thread(target=launch_until_refused, daemon=True)
    launcher.start()
    launcher.join(60)
    report(scenario="dies_enqueueing", errors=errors, launcher_ended=not launcher.is_alive(),
           seconds=time.monotonic() - started)
    backend.close()
    sys.exit(3)


def scenario_bad() -> None:
    # (Horovod's options, ours)
    cases = {
        "compression": (dict(compression=hvd.Compression.fp16), {}),
        "op": (dict(op=hvd.Min), {}),
        "adasum": (dict(op=hvd.Adasum), {}),
        "groups": (dict(groups=2), {}),
        "merge": ({}, dict(merge=True)),
    }
    errors = {}
    for case, (options, ours) in cases.items():
        model, _ = fresh_model("tiny")
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), **options,
        )
        try:
            bsc.ScheduledOptimizer(model, optimizer, 10, **ours)
        except Exception as error:  # noqa: BLE001 - the test asserts on what was raised
            errors[case] = {"type": type(error).__name__, "message": str(error)}
        else:
            errors[case] = None
    # Sparse gradients: refused at construction on every rank (no abort at exit).
    from bytescheduler.pytorch import GradientError

    embedding = torch.nn.Sequential(torch.nn.EmbeddingBag(50, 4, sparse=True), torch.nn.Linear(4, 2))
    try:
        bsc.ScheduledOptimizer(embedding, torch.optim.SGD(embedding.parameters(), lr=0.1), 10)
    except GradientError as error:
        errors["sparse"] = {"type": type(error).__name__, "message": str(error)}
    else:
        errors["sparse"] = None
    # Wrapping twice would register a second set of hooks: every update applied twice.
    model, _ = fresh_model("tiny")
    once = bsc.ScheduledOptimizer(
        model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters()), 10,
    )
    try:
        twice = bsc.ScheduledOptimizer(model, once, 10)
    except Exception as error:  # noqa: BLE001 - the test asserts on what was raised
        errors["twice"] = {"type": type(error).__name__, "message": str(error)}
    else:
        errors["twice"] = None
        twice.close()
    # hvd.join() while two ScheduledOptimizers are open: refused on the rank that calls it,
    # before it joins (rank 0 keeps going: nothing waits for rank 1's join).
    second_model, _ = fresh_model("tiny")
    second = bsc.ScheduledOptimizer(second_model, torch.optim.SGD(second_model.parameters(), lr=0.1))
    if hvd.rank() == 1:
        try:
            hvd.join()
        except Exception as error:  # noqa: BLE001 - the test asserts on what was raised
            errors["join"] = {"type": type(error).__name__, "message": str(error)}
        else:
            errors["join"] = None
    second.close()
    # With one open, every rank joins (no step taken: nothing to take part in).
    errors["join-one-open"] = {"last": hvd.join(), "ours": hvd.join is not bsc._horovods_join}
    once.close()
    # Every ScheduledOptimizer closed on every rank: Horovod's own join again.
    errors["join-after-close"] = {"last": hvd.join(), "restored": hvd.join is bsc._horovods_join}
    # A second backward before step() without backward_passes_per_step: an error on Horovod's
    # own path too (its hooks would all-reduce the summed gradient again), naming the fix.
    model, make_batch = fresh_model("tiny")
    plain = bsc.ScheduledOptimizer(
        model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters()), 10, start_plain=True,
    )
    x, y = batch(make_batch, 0)
    F.cross_entropy(model(x), y).backward()
    try:
        F.cross_entropy(model(x), y).backward()
    except Exception as error:  # noqa: BLE001 - the test asserts on what was raised
        errors["second"] = {"type": type(error).__name__, "message": str(error),
                            "mode": plain._bytescheduler.chooser.mode}
    else:
        errors["second"] = None
    plain.close(wait=False)
    report(scenario="bad", errors=errors)


# What rank 1 alone sets in the settings scenario.
ONE_RANK = {"BYTESCHEDULER_TIMEOUT": "45", "BYTESCHEDULER_PARTITION": "8KiB", "BYTESCHEDULER_CREDIT": "32KiB",
            "BYTESCHEDULER_FAST_LANE": "0", "BYTESCHEDULER_CYCLE_TIME": "7", "BYTESCHEDULER_TUNING": "1",
            "BYTESCHEDULER_ADAPTIVE": "0"}


def scenario_settings() -> None:
    import logging

    if hvd.rank() == 1:
        os.environ.update(ONE_RANK)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("bytescheduler").addHandler(handler)
    baseline_model, make_batch = fresh_model("cnn-small")
    scheduled_model, _ = fresh_model("cnn-small")
    baseline = hvd.DistributedOptimizer(make_optimizer("sgd", baseline_model),
                                        named_parameters=baseline_model.named_parameters())
    hvd.broadcast_parameters(baseline_model.state_dict(), root_rank=0)
    scheduled = bsc.ScheduledOptimizer(scheduled_model, hvd.DistributedOptimizer(
        make_optimizer("sgd", scheduled_model), named_parameters=scheduled_model.named_parameters()))
    config = scheduled._bytescheduler.scheduler.config
    for step in range(12):
        x, y = batch(make_batch, step)
        for model, optimizer in ((baseline_model, baseline), (scheduled_model, scheduled)):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    scheduled.synchronize()
    report(scenario="settings", max_abs_diff=max_difference(baseline_model, scheduled_model),
           config={field: getattr(config, field) for field in ("timeout", "partition_bytes", "credit_bytes",
                                                               "fast_lane_bytes", "cycle_ms", "auto_tune",
                                                               "adaptive")},
           warnings=[w for w in warnings if "rank 0's" in w])
    scheduled.close()


def _lockstep(options) -> dict:
    """Ours and Horovod side by side; after each step Horovod's model is reset to ours."""
    import random

    jitter = random.Random(1000 + hvd.rank())
    theirs, make_batch = fresh_model("cnn-small")
    ours, _ = fresh_model("cnn-small")
    baseline = hvd.DistributedOptimizer(torch.optim.SGD(theirs.parameters(), lr=0.05),
                                        named_parameters=theirs.named_parameters())
    hvd.broadcast_parameters(theirs.state_dict(), root_rank=0)
    optimizer = bsc.ScheduledOptimizer(ours, hvd.DistributedOptimizer(
        torch.optim.SGD(ours.parameters(), lr=0.05), named_parameters=ours.named_parameters()), **options)
    worst = 0.0
    for step in range(12):
        x, y = batch(make_batch, step)
        optimizer.zero_grad()
        time.sleep(jitter.uniform(0.0, 0.02))
        F.cross_entropy(ours(x), y).backward()
        optimizer.synchronize()
        grads = [p.grad.clone() for p in ours.parameters()]
        time.sleep(jitter.uniform(0.0, 0.02))
        with optimizer.skip_synchronize():
            optimizer.step()
        baseline.zero_grad()
        F.cross_entropy(theirs(x), y).backward()
        baseline.synchronize()
        for mine, reference in zip(grads, theirs.parameters()):
            worst = max(worst, ((mine - reference.grad).norm() / reference.grad.norm().clamp_min(1e-30)).item())
        baseline.zero_grad()  # its step would apply the gradient again: ours is the model
        optimizer.synchronize()
        with torch.no_grad():
            for reference, mine in zip(theirs.parameters(), ours.parameters()):
                reference.copy_(mine)
    checksum = float(sum(p.double().sum() for p in ours.parameters()))
    optimizer.close()
    return {"worst": worst, "checksum": checksum}


def scenario_many() -> None:
    from bytescheduler.core import modes

    os.environ["BYTESCHEDULER_MODE_SWITCH"] = modes.ModeSwitchParams(warmup=2, settle=1, trial=2, pairs=2, hold=3, trial_seconds=0, clear_hold=1, min_retrial=2, predict=False).text()
    if hvd.rank() == hvd.size() - 1:
        time.sleep(3.0)  # joins late: the others wait in the start-up agreement
    report(scenario="many", pieces=_lockstep(dict(partition_bytes="4KiB", credit_bytes="16KiB", adaptive=False)),
           switching=_lockstep({}))


def scenario_layout() -> None:
    from bytescheduler.core.agreement import LayoutMismatch

    messages = {}
    for case in ("shape", "count"):
        width = 3 if case == "shape" and hvd.rank() == 1 else 2
        layers = [torch.nn.Linear(4, 8), torch.nn.Linear(8, width)]
        if case == "count" and hvd.rank() == 1:
            layers.append(torch.nn.Linear(2, 2))
        model = torch.nn.Sequential(*layers)
        try:
            bsc.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        except LayoutMismatch as error:
            messages[case] = str(error)
        else:
            messages[case] = "no error"
    report(scenario="layout", messages=messages)


# ------------------------------------------------------------------ Horovod's optimizer surface

MAX_NORM = 0.1  # below the gradients' global norm, so that clipping scales them


class _Branchy(torch.nn.Module):
    """A body and a head, with a branch between them that a forward may leave out."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(32, 256)
        self.branch = torch.nn.Linear(256, 256)
        self.head = torch.nn.Linear(256, 10)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.body(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def _branchy():
    torch.manual_seed(1234)

    def make_batch(size, generator):
        return torch.randn(size, 32, generator=generator), torch.randint(0, 10, (size,), generator=generator)

    return _Branchy(), make_batch


def _side_by_side(body, name="cnn-small", kind="sgd", passes=1, steps=12, hvd_options=None, **ours):
    """``body(model, optimizer, step, make_batch)`` for ``steps`` steps on hvd.DistributedOptimizer
    alone, then on a ScheduledOptimizer over another (same model, same data); each under its own
    record of warnings (Python's default filter: one per place). Returns what differs."""
    import warnings

    built = [(_branchy if name == "branchy" else lambda: fresh_model(name))() for _ in range(2)]
    make_batch = built[0][1]
    optimizers = [hvd.DistributedOptimizer(make_optimizer(kind, model), named_parameters=model.named_parameters(),
                                           backward_passes_per_step=passes, **(hvd_options or {}))
                  for model, _ in built]
    hvd.broadcast_parameters(built[0][0].state_dict(), root_rank=0)
    optimizers[1] = bsc.ScheduledOptimizer(built[1][0], optimizers[1], partition_bytes=PARTITION, timeout=60, **ours)
    outcomes = []
    for (model, _), optimizer in zip(built, optimizers):
        schedule = make_schedule(kind, optimizer)
        values = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for step in range(steps):
                values.append(body(model, optimizer, step, make_batch))
                if schedule is not None:
                    schedule.step()
        outcomes.append((values, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]))
    scheduled = optimizers[1]
    scheduled.synchronize()
    chooser = scheduled._bytescheduler.chooser
    result = {
        "max_abs_diff": max_difference(built[0][0], built[1][0]),
        "values_equal": outcomes[0][0] == outcomes[1][0],
        "values": outcomes[1][0],
        "warnings": [outcomes[0][1], outcomes[1][1]],
        "checksum": checksum(built[1][0]),
        "operations": scheduled._bytescheduler.scheduler.stats["operations"],
        "modes": None if chooser is None else "".join(mode[0] for mode in chooser.history),
    }
    scheduled.close()
    return result


def _backward(model, optimizer, step, make_batch, passes=1, use_branch=None):
    loss = None
    for micro in range(passes):
        x, y = batch(make_batch, step, micro)
        output = model(x) if use_branch is None else model(x, use_branch=use_branch)
        loss = F.cross_entropy(output, y)
        loss.backward()
    return loss.item()


def _clipped(passes=1, unused_on=None):
    """Horovod's clipping idiom: synchronize(), clip_grad_norm_, step() inside skip_synchronize()
    (``unused_on``: the rank whose forward leaves the branch out, so that synchronize() must
    average zeros for it there)."""
    use_branch = None if unused_on is None else hvd.rank() != unused_on

    def body(model, optimizer, step, make_batch):
        optimizer.zero_grad()
        loss = _backward(model, optimizer, step, make_batch, passes, use_branch)
        optimizer.synchronize()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        with optimizer.skip_synchronize():
            optimizer.step()
        return [loss, norm.item()]
    return body


def _step_after_synchronize(model, optimizer, step, make_batch):
    """synchronize() then step() without skip_synchronize(): Horovod warns (once, by place)."""
    optimizer.zero_grad()
    loss = _backward(model, optimizer, step, make_batch)
    optimizer.synchronize()
    optimizer.step()
    return loss


def _zero_grad_too_early(passes):
    """zero_grad() after a backward, before step()/synchronize(): refused; after synchronize(): allowed
    (a step skipped, as a loss scaler skips one)."""
    def body(model, optimizer, step, make_batch):
        raised = []
        optimizer.zero_grad()
        loss = _backward(model, optimizer, step, make_batch, passes=1)
        try:
            optimizer.zero_grad()
        except AssertionError as error:
            raised.append(type(error).__name__)
        for micro in range(1, passes):
            _backward(model, optimizer, step, make_batch, passes=1)
        if step % 3 == 1:  # this step's gradients dropped, no step()
            optimizer.synchronize()
            optimizer.zero_grad()
            return [loss, raised, "dropped"]
        optimizer.step()
        return [loss, raised]
    return body


def _checkpoint_between(model, optimizer, step, make_batch):
    """load_state_dict() between synchronize() and step(): it clears Horovod's flag (no warning)."""
    optimizer.zero_grad()
    loss = _backward(model, optimizer, step, make_batch)
    optimizer.synchronize()
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    optimizer.step()
    return loss


def _plain(model, optimizer, step, make_batch):
    optimizer.zero_grad()
    loss = _backward(model, optimizer, step, make_batch)
    optimizer.step()
    return loss


def _attributes(optimizer) -> dict:
    names = ("op", "gradient_predivide_factor", "sparse_as_dense", "process_set", "backward_passes_per_step")
    return {name: repr(getattr(optimizer, name)) for name in names}


def scenario_surface() -> None:
    from bytescheduler.core import modes

    runs = {
        "clip": _side_by_side(_clipped(), adaptive=False),
        "clip-adamw-accumulate": _side_by_side(_clipped(passes=2), kind="adamw", passes=2, adaptive=False),
        "clip-gpt2": _side_by_side(_clipped(), name="gpt2-small", steps=6, adaptive=False),
        "warn": _side_by_side(_step_after_synchronize, steps=4, adaptive=False),
        "zero-grad": _side_by_side(_zero_grad_too_early(1), steps=6, adaptive=False),
        "zero-grad-accumulate": _side_by_side(_zero_grad_too_early(2), passes=2, steps=6, adaptive=False),
        "checkpoint": _side_by_side(_checkpoint_between, steps=4, adaptive=False),
        "sum": _side_by_side(_plain, hvd_options=dict(op=hvd.Sum), adaptive=False),
        "predivide": _side_by_side(_plain, kind="adamw", hvd_options=dict(gradient_predivide_factor=3.0),
                                   adaptive=False),
        "clip-unused-on-rank-1": _side_by_side(_clipped(unused_on=1), name="branchy", steps=6, adaptive=False),
        "clip-unused-accumulate": _side_by_side(_clipped(passes=2, unused_on=1), name="branchy", passes=2, steps=6,
                                                adaptive=False),
    }
    # The same with the mode switch on short phases: Horovod's own path runs too.
    os.environ["BYTESCHEDULER_MODE_SWITCH"] = modes.ModeSwitchParams(warmup=2, settle=1, trial=2, pairs=2, hold=3, trial_seconds=0, clear_hold=1, min_retrial=2, predict=False).text()
    runs["clip-switch"] = _side_by_side(_clipped(), steps=30, adaptive=True)
    runs["predivide-switch"] = _side_by_side(_plain, steps=30, hvd_options=dict(gradient_predivide_factor=3.0),
                                             adaptive=True)
    # What is read and set rather than trained.
    model, _ = fresh_model("tiny")
    baseline = hvd.DistributedOptimizer(make_optimizer("sgd", model), named_parameters=model.named_parameters(),
                                        backward_passes_per_step=2, gradient_predivide_factor=2.0)
    ours_model, _ = fresh_model("tiny")
    ours = bsc.ScheduledOptimizer(ours_model, hvd.DistributedOptimizer(
        make_optimizer("sgd", ours_model), named_parameters=ours_model.named_parameters(),
        backward_passes_per_step=2, gradient_predivide_factor=2.0), adaptive=False)
    errors = {}
    for passes in (2, 3):
        try:
            ours.set_backward_passes_per_step(passes)
            errors[passes] = None
        except ValueError as error:
            errors[passes] = str(error)
    surface = {
        "attributes": [_attributes(baseline), _attributes(ours)],
        "duplicates": [sorted(o.find_duplicates(["a", "b", "a", "c", "b"])) for o in (baseline, ours)],
        "set_passes": errors,
        "has": sorted(n for n in ("synchronize", "skip_synchronize", "set_backward_passes_per_step", "find_duplicates",
                                  "zero_grad", "load_state_dict") if callable(getattr(ours, n, None))),
    }
    ours.close()
    override_model, _ = fresh_model("tiny")
    override = bsc.ScheduledOptimizer(override_model, hvd.DistributedOptimizer(
        make_optimizer("sgd", override_model), named_parameters=override_model.named_parameters()),
        backward_passes_per_step=3, adaptive=False)
    surface["override_passes"] = override.backward_passes_per_step
    override.close()
    # The original API's num_steps: accepted, ignored, deprecated with a FutureWarning.
    import warnings

    steps_model, _ = fresh_model("tiny")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_steps = bsc.ScheduledOptimizer(steps_model, hvd.DistributedOptimizer(
            make_optimizer("sgd", steps_model), named_parameters=steps_model.named_parameters()), 100,
            adaptive=False)
    with_steps.close()
    surface["num_steps_warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                                     if "num_steps" in str(w.message)]
    report(scenario="surface", runs=runs, surface=surface)


SCENARIOS = {
    "equal": scenario_equal,
    "accumulate": scenario_accumulate,
    "idiom": scenario_idiom,
    "two": scenario_two,
    "credit": scenario_credit,
    "fallback": scenario_fallback,
    "tune": scenario_tune,
    "switch": scenario_switch,
    "dies": scenario_dies,
    "dies_enqueueing": scenario_dies_enqueueing,
    "stalls": scenario_stalls,
    "bad": scenario_bad,
    "settings": scenario_settings,
    "layout": scenario_layout,
    "many": scenario_many,
    "surface": scenario_surface,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    bsc.init()
    if hvd.size() < 2:
        sys.exit("run under horovodrun with at least 2 processes")
    SCENARIOS[args.scenario]()
    hvd.shutdown()


if __name__ == "__main__":
    main()
