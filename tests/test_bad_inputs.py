"""Bad input everywhere a user can give it: each a clear error naming the fix, on the rank
where it happened, and on the other ranks a ``RankFailed`` naming it instead of a wait.

Every case runs for real (settings through ``SchedulerConfig``, the torch adapters in a gloo
process group); what each raised, with its exact message, must be a row of the table in
docs/errors.md, so the documentation cannot drift from the code. After changing a message,
``BYTESCHEDULER_UPDATE_DOCS=1 pytest tests/test_bad_inputs.py`` rewrites the table.
Horovod's cases are in tests/test_horovod.py (``bad``), MXNet's in tests/mxnet/test_kvstore.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed import run_ranks

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
BEGIN, END = "<!-- table: tests/test_bad_inputs.py -->", "<!-- end of table -->"
ACCEPTED = "accepted"
# A message names the fix: what to use, pass, call, declare, create, register or leave.
HINT = r"\b(use|pass|give|call|declare|create|register|leave|must|accumulate)\b"

# (variable, value): the settings every adapter reads (SchedulerConfig.resolve).
ENVIRONMENT = [
    ("BYTESCHEDULER_PARTITION", "abc"), ("BYTESCHEDULER_PARTITION", "0"), ("BYTESCHEDULER_PARTITION", "-4"),
    ("BYTESCHEDULER_PARTITION", "1e6"), ("BYTESCHEDULER_PARTITION", "99999999999999999999"),
    ("BYTESCHEDULER_CREDIT", "lots"), ("BYTESCHEDULER_CREDIT", "0"),
    ("BYTESCHEDULER_FAST_LANE", "-1"), ("BYTESCHEDULER_FAST_LANE", "0"),
    ("BYTESCHEDULER_TIMEOUT", "abc"), ("BYTESCHEDULER_TIMEOUT", "0"), ("BYTESCHEDULER_TIMEOUT", "-1"),
    ("BYTESCHEDULER_TIMEOUT", "inf"), ("BYTESCHEDULER_TIMEOUT", "1e12"),
    ("BYTESCHEDULER_CYCLE_TIME", "fast"), ("BYTESCHEDULER_CYCLE_TIME", "-1"), ("BYTESCHEDULER_CYCLE_TIME", "1e9"),
    ("BYTESCHEDULER_MERGE", "2"), ("BYTESCHEDULER_TUNING", "maybe"), ("BYTESCHEDULER_ADAPTIVE", "sometimes"),
    ("BYTESCHEDULER_DEBUG", "verbose"), ("BYTESCHEDULER_DEBUG", ""),
]

# (keyword, value) given to an adapter.
KEYWORDS = [("partition_bytes", 1.5), ("partition_bytes", True), ("credit_bytes", -1), ("timeout", "soon"),
            ("cycle_ms", float("nan")), ("merge", "perhaps")]


def _outcome(action: Callable[[], object]) -> Tuple[str, str]:
    try:
        result = action()
    except Exception as error:  # noqa: BLE001 - the outcome is what we tabulate
        return type(error).__name__, str(error)
    return ACCEPTED, "" if result is None else str(result)


def _settings_cases() -> List[Tuple[str, str, str, str]]:
    from bytescheduler.core.config import SchedulerConfig

    rows = []
    for variable, value in ENVIRONMENT:
        def resolve(variable=variable, value=value):
            config = SchedulerConfig.resolve(environ={variable: value})
            if variable == "BYTESCHEDULER_TIMEOUT":
                return f"timeout={config.timeout:g} s"
            if variable == "BYTESCHEDULER_DEBUG":
                return f"log_level={config.log_level}"
            return None
        rows.append(("any adapter", f"`{variable}={value}`", *_outcome(resolve)))
    for keyword, value in KEYWORDS:
        rows.append(("any adapter", f"`{keyword}={value!r}`",
                     *_outcome(lambda keyword=keyword, value=value: SchedulerConfig.build(**{keyword: value}) and None)))
    rows += _plan_cases()
    rows.append(("any adapter", "`partition=4096` (a misspelled option)",
                 *_outcome(lambda: SchedulerConfig.build(partition=4096))))
    rows.append(("any adapter", "`config={'partition_bytes': 4096}` (a dict)",
                 *_outcome(lambda: SchedulerConfig.build({"partition_bytes": 4096}))))
    return rows


# (file name, its text): plan files for BYTESCHEDULER_PLAN, written in a folder of their own.
PLANS = [
    ("missing.json", None),
    ("notes.txt", "partition 4MiB, credit 16MiB"),
    ("profile.json", '{"model": "vgg", "layers": []}'),
    ("future.json", '{"format": "bytescheduler-plan", "version": 2, "schedule": true}'),
    ("no-credit.json", '{"format": "bytescheduler-plan", "version": 1, "schedule": true, "partition_bytes": 1024}'),
    ("bad-size.json", '{"format": "bytescheduler-plan", "version": 1, "schedule": true, "partition_bytes": "lots", '
                      '"credit_bytes": 1024}'),
    ("plain.json", '{"format": "bytescheduler-plan", "version": 1, "schedule": false, "partition_bytes": 1048576, '
                   '"credit_bytes": 4194304}'),
]


def _plan_cases() -> List[Tuple[str, str, str, str]]:
    """Plan files, good and bad, by relative name (so that messages do not depend on a temporary path)."""
    import tempfile

    from bytescheduler.core.config import SchedulerConfig

    def resolve(name):
        config = SchedulerConfig.resolve(environ={"BYTESCHEDULER_PLAN": name})
        return (f"partition_bytes={config.partition_bytes}, credit_bytes={config.credit_bytes}, "
                f"start_plain={config.start_plain}")

    rows = []
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            for name, text in PLANS:
                if text is not None:
                    Path(name).write_text(text, encoding="utf-8")
                rows.append(("any adapter", f"`BYTESCHEDULER_PLAN={name}`", *_outcome(lambda name=name: resolve(name))))
        finally:
            os.chdir(here)
    rows.append(("any adapter", "`plan=42`", *_outcome(lambda: SchedulerConfig.build(plan=42))))
    return rows


class _Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, ids):
        return F.embedding(ids, self.table, sparse=True).sum()


def _adapter_cases(rank, world_size) -> List[Tuple[str, str, str, str]]:
    """The torch adapters' cases on one process (a gloo group of 1: every call is real)."""
    import bytescheduler.pytorch as bsp
    from torch.nn.parallel import DistributedDataParallel as DDP

    rows = []
    model = nn.Linear(4, 2)

    def sgd(params=None):
        return torch.optim.SGD(model.parameters() if params is None else params, lr=0.1)

    def row(what, action):
        rows.append(("ScheduledOptimizer", what, *_outcome(action)))

    row("the model wrapped in DDP", lambda: bsp.ScheduledOptimizer(DDP(nn.Linear(4, 2)), sgd()))
    inner = nn.Linear(4, 2)
    wrapper = DDP(inner)  # noqa: F841 - alive, as Accelerate's prepare() leaves it
    row("the module inside a DDP wrapper (as Accelerate's `prepare` leaves it)",
        lambda: bsp.ScheduledOptimizer(inner, sgd(inner.parameters())))
    row("`optimizer=\"sgd\"` (not an optimizer)", lambda: bsp.ScheduledOptimizer(model, "sgd"))
    row("`model=\"net\"` (not a module)", lambda: bsp.ScheduledOptimizer("net", sgd()))
    row("an optimizer over another model's parameters", lambda: bsp.ScheduledOptimizer(model, sgd(nn.Linear(3, 3).parameters())))
    row("`backward_passes_per_step=0`", lambda: bsp.ScheduledOptimizer(model, sgd(), backward_passes_per_step=0))
    row("`backward_passes_per_step=\"2\"`", lambda: bsp.ScheduledOptimizer(model, sgd(), backward_passes_per_step="2"))
    row("`timeline=\"/proc/none/trace.json\"` (not writable)",
        lambda: bsp.ScheduledOptimizer(model, sgd(), timeline="/proc/none/trace.json"))
    optimizer = bsp.ScheduledOptimizer(model, sgd())
    row("wrapping a ScheduledOptimizer again", lambda: bsp.ScheduledOptimizer(model, optimizer))
    row("`step(closure)`", lambda: optimizer.step(lambda: 0.0))
    row("`step()` without a backward", lambda: optimizer.step())
    x = torch.randn(3, 4)

    def second_backward():
        optimizer.zero_grad()
        model(x).sum().backward()
        model(x).sum().backward()

    row("a second backward before `step()`", second_backward)
    optimizer.zero_grad()
    sparse = _Sparse()
    sparse_optimizer = bsp.ScheduledOptimizer(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1))
    row("a sparse gradient no module declares (`F.embedding(..., sparse=True)`)",
        lambda: sparse(torch.tensor([1, 2])).backward())
    sparse_optimizer.zero_grad()
    sparse_optimizer.close()
    optimizer.close()
    row("`close()` twice", lambda: optimizer.close())
    row("`step()` after `close()`", lambda: optimizer.step())

    def hook_row(what, action):
        rows.append(("DDP hook", what, *_outcome(action)))

    hook_row("`ScheduledHookState(process_group=\"world\")`", lambda: bsp.ScheduledHookState(process_group="world"))
    hook_row("`ScheduledHookState(model=\"net\")`", lambda: bsp.ScheduledHookState(model="net"))
    state = bsp.ScheduledHookState()
    ddp = DDP(nn.Linear(4, 2))
    ddp.register_comm_hook(state, bsp.scheduled_allreduce_hook)
    state.close()
    hook_row("`close()` twice", lambda: state.close())
    hook_row("a backward after `close()`", lambda: ddp(x).sum().backward())
    return rows


def _not_initialized() -> List[Tuple[str, str, str, str]]:
    import bytescheduler.pytorch as bsp
    import torch.distributed as dist

    assert not dist.is_initialized()
    model = nn.Linear(4, 2)
    return [("ScheduledOptimizer", "torch.distributed not initialized",
             *_outcome(lambda: bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))))]


def _one_rank_fails(rank, world_size):
    """Rank 1 passes a bad argument: it raises its error, rank 0 learns it at once."""
    import time

    import bytescheduler.pytorch as bsp

    model = nn.Linear(4, 2)
    started = time.monotonic()
    try:
        bsp.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               backward_passes_per_step=0 if rank == 1 else 1)
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error), time.monotonic() - started
    return "no error", "", 0.0


@pytest.fixture(scope="module")
def rows():
    found = _settings_cases() + _not_initialized()
    found += run_ranks(_adapter_cases, 1, deadline=120)[0]
    return [tuple(row) for row in found]


def _table(rows) -> str:
    def cell(text):
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| adapter | input | raises | message |", "|---|---|---|---|"]
    lines += [f"| {cell(a)} | {cell(b)} | {cell(c)} | {cell(d)} |" for a, b, c, d in rows]
    return "\n".join(lines)


def test_every_bad_input_is_refused_with_a_message_that_names_the_fix(rows):
    for adapter, what, raised, message in rows:
        if raised == ACCEPTED:
            continue
        assert raised.endswith("Error") or raised in ("SchedulerClosed",), (what, raised, message)
        # The message names what to use or do instead.
        assert re.search(HINT, message), \
            (what, message)


def test_accepted_inputs_are_the_documented_ones(rows):
    accepted = {what: message for _, what, raised, message in rows if raised == ACCEPTED}
    assert accepted == {
        "`BYTESCHEDULER_PARTITION=99999999999999999999`": "",  # larger than any tensor: never cut
        "`BYTESCHEDULER_FAST_LANE=0`": "",  # the fast lane off
        "`BYTESCHEDULER_TIMEOUT=1e12`": "timeout=1e+09 s",  # longer counts as 10^9 s
        "`BYTESCHEDULER_CYCLE_TIME=1e9`": "",  # held until the burst ends, as documented
        "`BYTESCHEDULER_DEBUG=`": "log_level=None",  # empty: logging off
        # A plan that says "don't schedule": its sizes, and the mode switch starts on the plain path.
        "`BYTESCHEDULER_PLAN=plain.json`": "partition_bytes=1048576, credit_bytes=4194304, start_plain=True",
        "`step()` without a backward": "",  # nothing to communicate: nothing changes
        "`close()` twice": "",  # idempotent, for both adapters
    }, accepted


def test_the_documented_table_is_what_the_code_raises(rows):
    table = _table(rows)
    text = DOC.read_text(encoding="utf-8")
    if os.environ.get("BYTESCHEDULER_UPDATE_DOCS") == "1":
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        DOC.write_text(text[:start] + "\n" + table + "\n" + text[end:], encoding="utf-8")
        text = DOC.read_text(encoding="utf-8")
    assert table in text, "docs/errors.md is out of date: run BYTESCHEDULER_UPDATE_DOCS=1 pytest tests/test_bad_inputs.py"


def test_a_bad_argument_on_one_rank_reaches_the_others_at_once():
    leader, follower = run_ranks(_one_rank_fails, 2, deadline=60)
    assert follower[0] == "ValueError" and "backward_passes_per_step=0" in follower[1], follower
    assert leader[0] == "RankFailed" and "rank 1 failed at start-up" in leader[1] \
        and "backward_passes_per_step=0" in leader[1], leader
    assert leader[2] < 10, leader  # no wait for a timeout
