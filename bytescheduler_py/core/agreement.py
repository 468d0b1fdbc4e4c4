"""One agreement at start-up: every rank runs with rank 0's settings, on the same model.

Environment variables differ between machines (one node's job script, one container's
image), and a setting that differs between ranks used to hang them: rank 0 would cut
pieces, hold work or open a mode-switch collective that the others never expected, or two
ranks would create their process groups under different timeouts. So before the first
operation every rank sends its effective :class:`~bytescheduler.core.config.SchedulerConfig`
and its model's parameter layout to every other (one gather, done by the adapter with its
framework's collective), and then:

- settings that shape what the ranks do together (:data:`FROM_RANK_0`) are taken from
  rank 0; a rank whose own value differed logs a warning naming the setting, its
  environment variable and both values;
- settings that are each rank's own business (:data:`PER_RANK`: the timeline path, the
  log level, the plan file read, whether averaged gradients become views of their buffer)
  stay as they are;
- a model whose parameters differ (names, shapes, dtypes, sparse or dense) is refused on
  every rank with :class:`LayoutMismatch`, naming the first differing parameter and the
  ranks: a local cause, reported as itself, never as a timeout.

>>> mine = SchedulerConfig(partition_bytes=1024, timeline="t.json")
>>> agreed, notes = from_rank_0(mine, SchedulerConfig(), rank=1)
>>> agreed.partition_bytes, agreed.timeline
(4194304, 't.json')
>>> print(notes[0])
rank 1: partition_bytes (BYTESCHEDULER_PARTITION) is 1024 here (an argument) but 4194304 on rank 0; using rank 0's value
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .config import ENVIRONMENT_OF, SchedulerConfig
from .errors import ByteSchedulerError, RankFailed
from .log import logger
from .modes import ModeSwitchParams

# (name, shape, dtype, sparse): one parameter as every rank describes it.
ParamInfo = Tuple[str, Tuple[int, ...], str, bool]
Layout = Optional[Sequence[ParamInfo]]
# What each rank sends: its settings and layout, or (None, None, its error as text).
Report = Tuple[Optional[SchedulerConfig], Optional[List[ParamInfo]], Optional[str]]

FROM_RANK_0 = ("partition_bytes", "credit_bytes", "merge", "fast_lane_bytes", "timeout", "auto_tune", "cycle_ms",
               "adaptive", "start_plain", "mode_switch")
# A plan file is read where it is given; what it set (partition, credit, start_plain) is agreed.
PER_RANK = ("timeline", "log_level", "plan", "grad_views")


class LayoutMismatch(ByteSchedulerError, ValueError):
    """The ranks' models differ: a parameter's name, shape, dtype or sparsity, or their number."""


def from_rank_0(mine: SchedulerConfig, leader: SchedulerConfig, rank: int) -> Tuple[SchedulerConfig, List[str]]:
    """``mine`` with rank 0's values of :data:`FROM_RANK_0`, and a note per value that changed."""
    notes = []
    for field in FROM_RANK_0:
        own, theirs = getattr(mine, field), getattr(leader, field)
        if own != theirs:
            notes.append(f"rank {rank}: {_name(field)} is {own!r} here ({_origin(mine, field)}) but {theirs!r} "
                         "on rank 0; using rank 0's value")
    return replace(mine, **{field: getattr(leader, field) for field in FROM_RANK_0}), notes


def shared_settings(config: SchedulerConfig) -> Dict[str, Any]:
    """``config``'s values of :data:`FROM_RANK_0` as JSON values (for an adapter that sends
    rank 0's settings as text; :func:`with_shared_settings` reads them back).

    >>> import json
    >>> config = SchedulerConfig(partition_bytes=1024, mode_switch=ModeSwitchParams(hold=40))
    >>> sent = json.loads(json.dumps(shared_settings(config)))
    >>> with_shared_settings(SchedulerConfig(), sent) == config
    True
    """
    values = {field: getattr(config, field) for field in FROM_RANK_0}
    if values["mode_switch"] is not None:
        values["mode_switch"] = values["mode_switch"].text()
    return values


def with_shared_settings(mine: SchedulerConfig, sent: Dict[str, Any]) -> SchedulerConfig:
    """``mine`` with the values of :func:`shared_settings` (rank 0's), None ones included."""
    values = dict(sent)
    if values.get("mode_switch") is not None:
        values["mode_switch"] = ModeSwitchParams.parse(values["mode_switch"])
    return replace(mine, **values)


def check_layouts(layouts: Sequence[Optional[Sequence[ParamInfo]]]) -> None:
    """Raise :class:`LayoutMismatch` at the first parameter where a rank's layout differs
    from rank 0's (None: a rank with nothing to compare, e.g. the DDP hook)."""
    reference = layouts[0]
    if reference is None:
        return
    for rank, layout in enumerate(layouts[1:], start=1):
        if layout is None:
            continue
        for index, (ours, theirs) in enumerate(zip(reference, layout)):
            if ours != theirs:
                raise LayoutMismatch(
                    f"the model differs between ranks: parameter {index} is {_describe(ours)} on rank 0 "
                    f"but {_describe(theirs)} on rank {rank}; every rank must build the same model "
                    "(same parameters in the same order)")
        if len(reference) != len(layout):
            shorter, longer = (0, rank) if len(reference) < len(layout) else (rank, 0)
            extra = (layout if longer == rank else reference)[min(len(reference), len(layout))]
            raise LayoutMismatch(
                f"the model differs between ranks: rank 0 has {len(reference)} parameters, rank {rank} "
                f"has {len(layout)}; rank {longer} has {_describe(extra)} where rank {shorter}'s end; "
                "every rank must build the same model")


def attempt(build: Callable[[], Tuple[SchedulerConfig, Layout]]) -> Tuple[Report, Optional[BaseException]]:
    """Run this rank's ``build`` (its argument checks and its settings): the report it sends
    to the others and, if it failed, its error (raised after the gather, so that the others
    learn of it instead of waiting for this rank in the next collective)."""
    try:
        config, layout = build()
    except Exception as error:  # noqa: BLE001 - every rank must hear of it, then it is raised here
        return (None, None, f"{type(error).__name__}: {error}"), error
    return (config, None if layout is None else list(layout), None), None


def settle(reports: Sequence[Report], rank: int, failure: Optional[BaseException]) -> SchedulerConfig:
    """Every rank's reports, gathered in rank order: raise this rank's own error, or
    :class:`~bytescheduler.core.errors.RankFailed` for the first rank that failed, or return
    rank 0's shared settings (:func:`agree`)."""
    if failure is not None:
        raise failure
    for other, (_, _, error) in enumerate(reports):
        if error is not None:
            raise RankFailed(f"rank {other} failed at start-up, so this rank stops too: {error}")
    mine = reports[rank][0]
    assert mine is not None
    return agree(mine, [(config, layout) for config, layout, _ in reports], rank)


def agree(config: SchedulerConfig, everyone: Sequence[Tuple[SchedulerConfig, Optional[Sequence[ParamInfo]]]],
          rank: int) -> SchedulerConfig:
    """The agreement itself, once every rank's ``(config, layout)`` was gathered (in rank
    order, by the adapter's collective): checks the layouts, logs what differs, and returns
    ``config`` with rank 0's shared settings. Every rank reaches the same verdict."""
    check_layouts([layout for _, layout in everyone])
    agreed, notes = from_rank_0(config, everyone[0][0], rank)
    for note in notes:
        logger.warning(note)
    if rank == 0:
        for other, (theirs, _) in enumerate(everyone[1:], start=1):
            differing = [field for field in FROM_RANK_0 if getattr(theirs, field) != getattr(config, field)]
            if differing:
                logger.info("rank %d's %s differed from rank 0's; it runs with rank 0's", other,
                            ", ".join(_name(field) for field in differing))
    return agreed


def _name(field: str) -> str:
    variable = ENVIRONMENT_OF.get(field)
    return f"{field} ({variable})" if variable else field


def _origin(config: SchedulerConfig, field: str) -> str:
    """Where this rank's value came from, in words: what to fix where it should not differ."""
    return {"argument": "an argument", "environment": "from the environment", "plan": "from a plan",
            "default": "the default"}[config.source(field)]


def _describe(info: ParamInfo) -> str:
    name, shape, dtype, sparse = info
    return f"{name!r} of shape {tuple(shape)}, {dtype}{', sparse' if sparse else ''}"
