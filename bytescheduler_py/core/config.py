"""Configuration: keyword arguments override environment variables, which override defaults.

Sizes are bytes. Strings such as ``"4MB"`` (SI, 4,000,000), ``"4MiB"`` (binary,
4,194,304), ``"512KiB"`` or plain integers are accepted everywhere a size is.

>>> parse_size("512KiB", "partition_bytes")
524288
>>> SchedulerConfig.resolve(partition_bytes="1MB").partition_bytes
1000000
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, Mapping, Optional

from .modes import ModeSwitchParams
from .plan import read_plan
from .values import (  # noqa: F401 - the parsers are also this module's (their first home)
    MAX_TIMEOUT,
    SIZE_FORMS,
    Size,
    format_size,
    parse_bool,
    parse_log_level,
    parse_milliseconds,
    parse_nonnegative_size,
    parse_size,
    parse_timeout,
)

ENV_PARTITION = "BYTESCHEDULER_PARTITION"
ENV_CREDIT = "BYTESCHEDULER_CREDIT"
ENV_TIMELINE = "BYTESCHEDULER_TIMELINE"
ENV_DEBUG = "BYTESCHEDULER_DEBUG"
ENV_TIMEOUT = "BYTESCHEDULER_TIMEOUT"
ENV_MERGE = "BYTESCHEDULER_MERGE"
ENV_FAST_LANE = "BYTESCHEDULER_FAST_LANE"
ENV_TUNING = "BYTESCHEDULER_TUNING"
ENV_CYCLE = "BYTESCHEDULER_CYCLE_TIME"
ENV_ADAPTIVE = "BYTESCHEDULER_ADAPTIVE"
ENV_GRAD_VIEWS = "BYTESCHEDULER_GRAD_VIEWS"
ENV_PLAN = "BYTESCHEDULER_PLAN"
ENV_MODE_SWITCH = "BYTESCHEDULER_MODE_SWITCH"

# Where a setting's value came from (SchedulerConfig.source), strongest last.
DEFAULT, PLAN, ENVIRONMENT, ARGUMENT = "default", "plan", "environment", "argument"
SOURCES = (DEFAULT, PLAN, ENVIRONMENT, ARGUMENT)


@dataclass(frozen=True)
class SchedulerConfig:
    """Every knob of the scheduler, in bytes and seconds.

    partition_bytes: tensors larger than this are split into pieces of at most this size,
        and small pieces are merged into operations of at most this size.
    credit_bytes: at most this many bytes are in flight at once (a single piece larger
        than the credit goes out alone when nothing else is in flight).
    merge: fuse small ready pieces of the same dtype/device into one operation.
    fast_lane_bytes: operations of at most this size go to a second communication lane, with
        a window of its own of this many bytes, so an urgent small tensor neither queues behind
        large ones in the backend's FIFO nor waits for a full main credit; 0 turns it off.
        Bytes in flight never exceed ``credit_bytes + fast_lane_bytes``.
    timeout: seconds a communication operation (or a peer it waits for) may take before
        :class:`~bytescheduler.core.errors.CommunicationTimeout` is raised.
    timeline: path of the Chrome trace to write (one file per rank), or None.
    log_level: logging level for the ``bytescheduler`` logger (stderr), or None.
    auto_tune: search partition and credit sizes online from measured step times,
        starting from ``partition_bytes`` and ``credit_bytes`` (see
        :mod:`bytescheduler.core.tuning`); the math is unchanged.
    cycle_ms: how long the deciding rank may hold queued work, waiting for more to merge
        with, while less than ``partition_bytes`` is queued (as Horovod's cycle time). It
        stops holding at once when the adapter signals the end of a burst (the end of
        backward), on flush and on stop, so the last, most urgent tensors are never held.
        On a fast link, where each tensor would otherwise go alone, it saves the fixed cost
        of most operations; 0 launches whatever the credit admits immediately.
    adaptive: let rank 0 time the scheduled path against the framework's own (plain) path
        and run the faster, trying the other again now and then
        (:mod:`bytescheduler.core.modes`); the math is the same either way.
        ScheduledOptimizer (torch and Horovod) turns it on by default; it is off with
        ``auto_tune``, which tunes the scheduled path.
    grad_views: after a bucket of several gradients is averaged in one buffer (the DDP
        hook's buckets, ScheduledOptimizer's plain path), make each large, contiguous
        parameter's ``.grad`` a view of its place in that buffer instead of copying the
        average back, as DDP's ``gradient_as_bucket_view`` does: the same values, one pass
        over the gradients fewer. A ``.grad`` kept from an earlier iteration then shows
        later values; keep a ``.clone()`` (:mod:`bytescheduler.pytorch.grad_views`).
    start_plain: with ``adaptive``, start on the framework's own path and hold it as if the
        mode switch had chosen it (the scheduled path is tried after the hold), instead of
        timing both paths first; what a plan that predicts no gain sets.
    plan: path of a plan written by ``bytescheduler plan`` (:mod:`bytescheduler.core.plan`).
        Its partition, credit and choice to schedule or not (``start_plain``) take the place
        of the adapter's defaults: settings given explicitly (keywords, the environment)
        still win, and ``auto_tune`` starts its search from the plan's setting.
    mode_switch: with ``adaptive``, how the mode switch times the two paths: a
        :class:`~bytescheduler.core.modes.ModeSwitchParams` (or a dict of its fields, or
        ``"hold=400,trial=8"``); None: the adapter's defaults.

    Every config also records where each value came from (:meth:`source`): a keyword
    argument, the environment, a plan or a default (the class's or the adapter's). A config
    built directly, ``SchedulerConfig(credit_bytes=...)``, counts the values that differ from
    the class defaults as arguments.

    >>> config = SchedulerConfig.resolve(environ={"BYTESCHEDULER_CREDIT": "8MiB"}, timeout=60)
    >>> config.source("credit_bytes"), config.source("timeout"), config.source("merge")
    ('environment', 'argument', 'default')
    >>> SchedulerConfig(credit_bytes=8).source("credit_bytes")
    'argument'
    """

    partition_bytes: int = 4 * 1024**2
    credit_bytes: int = 16 * 1024**2
    merge: bool = True
    fast_lane_bytes: int = 1024**2
    timeout: float = 300.0
    timeline: Optional[str] = None
    log_level: Optional[int] = None
    auto_tune: bool = False
    cycle_ms: float = 0.0
    adaptive: bool = False
    grad_views: bool = True
    start_plain: bool = False
    plan: Optional[str] = None
    mode_switch: Optional[ModeSwitchParams] = None
    # field -> where its value came from (DEFAULT when absent); None: built directly (see above).
    sources: Optional[Mapping[str, str]] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.sources is None:
            given = [f.name for f in fields(self) if f.name in _PARSERS and getattr(self, f.name) != f.default]
            object.__setattr__(self, "sources", dict.fromkeys(given, ARGUMENT))
        elif not isinstance(self.sources, dict):
            object.__setattr__(self, "sources", dict(self.sources))

    def source(self, name: str) -> str:
        """Where setting ``name``'s value came from: ``"argument"`` (a keyword, or a config built
        with it), ``"environment"``, ``"plan"`` or ``"default"`` (the class's or the adapter's)."""
        if name not in _PARSERS:
            raise KeyError(f"{name!r} is not a scheduler option; use one of {sorted(_PARSERS)}")
        return self.sources.get(name, DEFAULT)

    def given(self, name: str) -> bool:
        """True when setting ``name`` was chosen (an argument, the environment or a plan), not a default."""
        return self.source(name) != DEFAULT

    def _with(self, values: Mapping[str, Any], source: str) -> "SchedulerConfig":
        """A copy with ``values`` (already parsed) set, recorded as coming from ``source``."""
        sources: Dict[str, str] = dict(self.sources)
        sources.update((name, source) for name in values)
        return replace(self, **values, sources=sources)

    @classmethod
    def resolve(cls, environ: Optional[Mapping[str, str]] = None, defaults: Optional["SchedulerConfig"] = None,
                **overrides: Any) -> "SchedulerConfig":
        """Build a config from ``defaults`` (default: the class defaults), then a plan (the
        ``plan`` keyword, else ``BYTESCHEDULER_PLAN``), then ``environ`` (default
        ``os.environ``), then keywords.

        Keywords whose value is None are ignored, so adapters can pass their arguments through.
        """
        env = os.environ if environ is None else environ
        # The defaults are defaults, however they were built (an adapter's are built directly).
        base = replace(defaults if defaults is not None else cls(), sources={})
        plan = overrides.get("plan") if overrides.get("plan") is not None else env.get(ENV_PLAN) or None
        if plan is not None:
            base = base.with_plan(plan)
        from_environment = {
            option: _PARSERS[option](env[name], name)
            for name, option in _ENVIRONMENT.items()
            # An empty BYTESCHEDULER_DEBUG means "off"; other empty variables are unset.
            if env.get(name) or (name == ENV_DEBUG and name in env)
        }
        return base._with(from_environment, ENVIRONMENT)._with(_parse_options(overrides), ARGUMENT)

    @classmethod
    def build(cls, config: Optional["SchedulerConfig"] = None, defaults: Optional["SchedulerConfig"] = None,
              **options: Any) -> "SchedulerConfig":
        """What an adapter runs with: ``config`` as given or, without one, ``defaults`` (the
        adapter's own) read over by the environment; then the keyword ``options`` on top.

        Every adapter takes ``config=None, **options`` and passes them here, so the options
        are defined once, on this class.

        >>> SchedulerConfig.build(SchedulerConfig(credit_bytes=8), partition_bytes="4KiB").credit_bytes
        8
        """
        if config is None:
            return cls.resolve(defaults=defaults, **options)
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a bytescheduler SchedulerConfig, not {type(config).__name__}")
        return config.with_options(**options)

    def with_options(self, **overrides: Any) -> "SchedulerConfig":
        """A copy with the given keywords (None ones ignored) parsed and applied; no environment.
        A ``plan`` is applied first, so the other keywords override it."""
        base = self if overrides.get("plan") is None else self.with_plan(overrides["plan"])
        return base._with(_parse_options(overrides), ARGUMENT)

    def with_plan(self, path: Any) -> "SchedulerConfig":
        """A copy with the settings of the plan in file ``path``: its partition and credit,
        and ``start_plain`` when it says not to schedule.

        >>> import json, tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        ...     json.dump({"format": "bytescheduler-plan", "version": 1, "schedule": False,
        ...                "partition_bytes": 1024, "credit_bytes": 4096}, f)
        >>> config = SchedulerConfig().with_plan(f.name)
        >>> config.partition_bytes, config.credit_bytes, config.start_plain
        (1024, 4096, True)
        >>> os.remove(f.name)
        """

        plan = read_plan(path)
        return self._with({"plan": os.fspath(path), "partition_bytes": plan.partition_bytes,
                           "credit_bytes": plan.credit_bytes, "start_plain": not plan.schedule}, PLAN)


_PARSERS = {
    "partition_bytes": parse_size,
    "credit_bytes": parse_size,
    "fast_lane_bytes": parse_nonnegative_size,
    "merge": parse_bool,
    "auto_tune": parse_bool,
    "timeout": parse_timeout,
    "log_level": parse_log_level,
    "timeline": lambda value, name: os.fspath(value),
    "cycle_ms": parse_milliseconds,
    "adaptive": parse_bool,
    "grad_views": parse_bool,
    "start_plain": parse_bool,
    "plan": lambda value, name: os.fspath(value),
    "mode_switch": ModeSwitchParams.parse,
}


_ENVIRONMENT = {
    ENV_PARTITION: "partition_bytes",
    ENV_CREDIT: "credit_bytes",
    ENV_MERGE: "merge",
    ENV_FAST_LANE: "fast_lane_bytes",
    ENV_TIMEOUT: "timeout",
    ENV_TIMELINE: "timeline",
    ENV_DEBUG: "log_level",
    ENV_TUNING: "auto_tune",
    ENV_CYCLE: "cycle_ms",
    ENV_ADAPTIVE: "adaptive",
    ENV_GRAD_VIEWS: "grad_views",
    ENV_PLAN: "plan",
    ENV_MODE_SWITCH: "mode_switch",
}


# field -> its environment variable, for messages.
ENVIRONMENT_OF = {field: name for name, field in _ENVIRONMENT.items()}


def _parse_options(overrides: Mapping[str, Any]) -> dict:
    unknown = sorted(set(overrides) - set(_PARSERS))
    if unknown:
        hints = [f"{close[0]!r} for {name!r}" for name in unknown
                 for close in [difflib.get_close_matches(name, _PARSERS, n=1, cutoff=0.5)] if close]
        raise TypeError(f"unknown scheduler option(s) {unknown}" + (f" (did you mean {', '.join(hints)}?)" if hints else "")
                        + f"; use one of {sorted(_PARSERS)}")
    return {name: _PARSERS[name](value, name) for name, value in overrides.items() if value is not None}


# The keywords every adapter takes: SchedulerConfig's fields (its provenance record aside).
OPTION_NAMES = frozenset(f.name for f in fields(SchedulerConfig) if f.name != "sources")
