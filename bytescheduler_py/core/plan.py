"""A plan: the settings ``bytescheduler plan`` recommends for one model on one cluster.

The planner (:mod:`bytescheduler_tools.sim.planner`) searches partition x credit, and "don't
schedule" (the framework's own path), with the simulator and writes its choice as JSON;
the runtime reads it when an adapter is given ``plan=FILE`` or ``BYTESCHEDULER_PLAN=FILE``
(:class:`~bytescheduler.core.config.SchedulerConfig`, where it takes the place of the
adapter's defaults). Only three fields steer the runtime: ``schedule``, ``partition_bytes``
and ``credit_bytes``; ``details`` carries what the planner predicted, for people.

>>> plan = Plan(schedule=False, partition_bytes=4 << 20, credit_bytes=16 << 20)
>>> Plan.from_json(plan.to_json(), "plan.json") == plan
True
>>> Plan.from_json('{"format": "bytescheduler-plan", "version": 1}', "p.json")
Traceback (most recent call last):
...
bytescheduler.core.plan.PlanError: plan file 'p.json' has no 'schedule': create the plan again with `bytescheduler plan ... --json FILE`
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict

from .values import parse_bool, parse_size
from .errors import ByteSchedulerError

FORMAT = "bytescheduler-plan"
VERSION = 1
_REMAKE = "create the plan again with `bytescheduler plan ... --json FILE`"


class PlanError(ByteSchedulerError, ValueError):
    """A plan file that cannot be used: unreadable, not a plan, or with a bad setting."""


@dataclass(frozen=True)
class Plan:
    """What to run: the scheduled path with these sizes, or the framework's own path.

    schedule: False when the framework's own path is predicted as fast as any setting
        (the adapter's mode switch then starts on it; see ``start_plain``).
    partition_bytes, credit_bytes: the best scheduled setting found (also kept when
        ``schedule`` is False: the mode switch and the tuner use them when they schedule).
    details: the planner's inputs and predictions (model, cluster, the table); not read
        by the runtime.
    """

    schedule: bool
    partition_bytes: int
    credit_bytes: int
    details: Dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "schedule": self.schedule,
                           "partition_bytes": self.partition_bytes, "credit_bytes": self.credit_bytes,
                           "details": self.details}, indent=1)

    @classmethod
    def from_json(cls, text: str, path: str) -> "Plan":
        """Parse a plan; ``path`` names the file in errors."""
        try:
            data = json.loads(text)
        except ValueError as error:
            raise PlanError(f"plan file {path!r} is not JSON ({error}): give a plan written by "
                            "`bytescheduler plan ... --json FILE`") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanError(f"plan file {path!r} is not a bytescheduler plan (no \"format\": \"{FORMAT}\"): "
                            "give a plan written by `bytescheduler plan ... --json FILE`")
        if data.get("version") != VERSION:
            raise PlanError(f"plan file {path!r} has version {data.get('version')!r} but this bytescheduler reads "
                            f"version {VERSION}: create the plan again with this version's `bytescheduler plan`")
        values = {}
        for name, parse in (("schedule", parse_bool), ("partition_bytes", parse_size), ("credit_bytes", parse_size)):
            if name not in data:
                raise PlanError(f"plan file {path!r} has no {name!r}: {_REMAKE}")
            try:
                values[name] = parse(data[name], name)
            except ValueError as error:
                raise PlanError(f"plan file {path!r}: {error}; or {_REMAKE}") from None
        details = data.get("details")
        return cls(details=details if isinstance(details, dict) else {}, **values)


def read_plan(path: Any) -> Plan:
    """The plan in file ``path``; :class:`PlanError` says what is wrong and what to do."""
    if not isinstance(path, (str, os.PathLike)):
        raise PlanError(f"plan={path!r} is not a path: pass the plan file's path (written by "
                        "`bytescheduler plan ... --json FILE`)")
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise PlanError(f"plan file {path!r} cannot be read ({reason}): give the path of a plan written by "
                        "`bytescheduler plan ... --json FILE`") from None
    return Plan.from_json(text, path)
