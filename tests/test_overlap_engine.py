"""ScheduledOptimizer's engine on a real (one-rank) gloo process: the read guard's lifetime,
busy counts kept per engine, and errors of the user's optimizer reaching the training thread
as themselves."""

from __future__ import annotations

import sys
import threading

import torch

from tests.distributed import run_ranks


class OddError(Exception):
    """An exception whose constructor does not take a message (``type(e)(str(e))`` fails)."""

    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")
        self.code = code


class ExplodingSGD(torch.optim.SGD):
    """SGD whose update raises OddError once a param group has ``explode`` set."""

    def step(self, closure=None):
        if self.param_groups[0].get("explode"):
            raise OddError(3, "the update exploded")
        return super().step(closure)


def _guards() -> int:
    from torch.overrides import _get_current_function_mode_stack

    return sum(type(mode).__name__.endswith("ReadGuard") for mode in _get_current_function_mode_stack())


def _train_once(model, optimizer):
    optimizer.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()


def _guard_lifetime(rank, world_size):
    import bytescheduler.pytorch as bsp

    def make():
        model = torch.nn.Linear(4, 4)
        return model, bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))

    seen = [_guards()]
    (model_a, a), (model_b, b) = make(), make()
    seen.append(_guards())  # two optimizers, one guard
    _train_once(model_a, a)
    _train_once(model_b, b)
    a.close()
    seen.append(_guards())  # b still needs it
    b.close()
    seen.append(_guards())  # the last one closed: popped
    _, c = make()
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join()
    seen.append(_guards())  # closed on another thread: left on this thread, inert
    model_d, d = make()
    _train_once(model_d, d)
    seen.append(_guards())  # the next optimizer here reuses it
    d.close()
    seen.append(_guards())
    return seen


def test_the_read_guard_is_removed_when_the_last_optimizer_on_its_thread_closes():
    [seen] = run_ranks(_guard_lifetime, 1, deadline=90)
    assert seen == [0, 1, 1, 0, 1, 1, 0], seen


def _optimizer_error(rank, world_size):
    import bytescheduler.pytorch as bsp

    model = torch.nn.Linear(4, 4)
    optimizer = bsp.ScheduledOptimizer(model, ExplodingSGD(model.parameters(), lr=0.1))
    _train_once(model, optimizer)
    optimizer.param_groups[0]["explode"] = True
    _train_once(model, optimizer)
    try:
        optimizer.synchronize()
    except BaseException as error:  # noqa: BLE001 - what reached the training thread
        raised = error
    else:
        raised = None
    optimizer.close(wait=False)
    chain = []
    while raised is not None:
        chain.append((type(raised).__name__, str(raised)))
        raised = raised.__cause__
    return chain


def test_an_error_of_the_users_update_reaches_the_training_thread_as_itself():
    [chain] = run_ranks(_optimizer_error, 1, deadline=90)
    assert chain and chain[0] == ("OddError", "3: the update exploded"), chain
    assert chain[-1] == ("OddError", "3: the update exploded"), chain  # the original, with its traceback


def _busy_under_concurrent_transitions(rank, world_size):
    import bytescheduler.pytorch as bsp
    from bytescheduler.pytorch.params import IDLE, QUEUED

    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show at once
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    optimizers = [bsp.ScheduledOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in models]
    engines = [optimizer._bytescheduler for optimizer in optimizers]
    models[0](torch.ones(2, 4)).sum().backward()  # the first model's gradients are in flight, not the second's
    during_backward = [engine.busy for engine in engines]
    optimizers[0].step()
    optimizers[0].synchronize()

    def flip(engine):
        state = next(iter(engine.states.values()))
        for _ in range(20_000):
            with engine.progress.cond:
                engine.progress.set_stage(state, QUEUED)
            with engine.progress.cond:
                engine.progress.set_stage(state, IDLE)

    threads = [threading.Thread(target=flip, args=(engine,)) for engine in engines for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sys.setswitchinterval(0.005)
    busy = [engine.busy for engine in engines]
    for optimizer in optimizers:
        optimizer.close()
    return during_backward, busy


def test_two_optimizers_in_one_process_keep_their_busy_counts_apart():
    [(during_backward, after)] = run_ranks(_busy_under_concurrent_transitions, 1, deadline=120)
    assert during_backward[0] in (1, 2) and during_backward[1] == 0, during_backward
    assert after == [0, 0]


def test_updates_are_batched_by_group_and_step_in_forward_order_and_size():
    from bytescheduler.pytorch import updates
    from bytescheduler.pytorch.params import ParamState as _ParamState
    from bytescheduler.pytorch.updates import batches as _batches

    def state(key, numel, priority, group=0, step=1):
        s = _ParamState(torch.nn.Parameter(torch.zeros(numel)), key, f"p{key}", priority, group)
        s.step_number = step
        return s

    big = updates.BATCH_ELEMENTS
    a, b, c = state(0, 10, 2), state(1, 10, 0), state(2, 10, 1)
    other_group, next_step = state(3, 10, 3, group=1), state(4, 10, 4, step=2)
    large, after_large = state(5, big - 5, 5), state(6, 10, 6)
    batches = _batches([a, other_group, next_step, large, b, after_large, c])
    keys = [[s.key for s in batch] for batch in batches]
    # Forward order within a step; a new group starts a batch; a batch stays under BATCH_ELEMENTS.
    assert keys == [[1, 2, 0], [3], [5], [6], [4]], keys


def test_the_shared_progress_docstring_example_runs():
    import doctest

    from bytescheduler.pytorch import progress

    result = doctest.testmod(progress)
    assert result.failed == 0 and result.attempted > 0, result
