"""Configuration: sizes, environment variables, keyword precedence and error messages."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pytest

from bytescheduler.core import Scheduler, SchedulerConfig
from bytescheduler.core.config import parse_size
from tests.fakes import WAIT, FakeBackend, make_task

ENV_NAMES = [
    "BYTESCHEDULER_PARTITION",
    "BYTESCHEDULER_CREDIT",
    "BYTESCHEDULER_TIMELINE",
    "BYTESCHEDULER_DEBUG",
    "BYTESCHEDULER_TIMEOUT",
    "BYTESCHEDULER_MERGE",
    "BYTESCHEDULER_FAST_LANE",
    "BYTESCHEDULER_CYCLE_TIME",
]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def resolve(env=None, **overrides):
    return SchedulerConfig.resolve(environ=env or {}, **overrides)


# ---------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4MB", 4_000_000),
        ("4MiB", 4 * 1024**2),
        ("512KiB", 512 * 1024),
        ("1GB", 10**9),
        ("1GiB", 1024**3),
        ("4mb", 4_000_000),
        ("4 MB", 4_000_000),
        (" 64KB ", 64_000),
        ("4M", 4_000_000),
        ("4k", 4_000),
        ("100", 100),
        ("100B", 100),
        ("1.5KiB", 1536),
        ("0.5MB", 500_000),
        (4096, 4096),
        (1, 1),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text, "partition_bytes") == expected


@pytest.mark.parametrize(
    "text, expected",
    [("4.1MB", 4_100_000), ("2.01KB", 2010), ("8.2MB", 8_200_000), ("0.57KB", 570), ("1.1MB", 1_100_000)],
)
def test_parse_size_decimal_sizes_are_exact(text, expected):
    # A decimal size that names a whole number of bytes must give exactly that number.
    assert parse_size(text, "partition_bytes") == expected


@pytest.mark.parametrize("value", ["", "lots", "4TB", "-5", "-5MB", "4 M B", "1e6", "0x10", "MB", 4.0, None, True, [4]])
def test_parse_size_rejects(value):
    with pytest.raises(ValueError) as info:
        parse_size(value, "credit_bytes")
    message = str(info.value)
    assert "credit_bytes" in message
    assert "4MiB" in message and "512KiB" in message  # names the accepted forms


@pytest.mark.parametrize("value", [0, "0", "0MB", "0.4"])
def test_parse_size_rejects_zero(value):
    with pytest.raises(ValueError, match="credit_bytes.*positive"):
        parse_size(value, "credit_bytes")


# ---------------------------------------------------------------------------- defaults and env


def test_defaults():
    config = resolve()
    assert config == SchedulerConfig()
    assert config.partition_bytes == 4 * 1024**2
    assert config.credit_bytes == 16 * 1024**2
    assert config.merge is True
    assert config.fast_lane_bytes == 1024**2
    assert config.timeout == 300.0
    assert config.timeline is None and config.log_level is None
    assert config.cycle_ms == 0.0


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SchedulerConfig().partition_bytes = 1


def test_environment_values():
    config = resolve({
        "BYTESCHEDULER_PARTITION": "1MB",
        "BYTESCHEDULER_CREDIT": "8MiB",
        "BYTESCHEDULER_TIMELINE": "/tmp/trace.json",
        "BYTESCHEDULER_DEBUG": "1",
        "BYTESCHEDULER_TIMEOUT": "2.5",
        "BYTESCHEDULER_MERGE": "off",
        "BYTESCHEDULER_FAST_LANE": "64KiB",
    })
    assert config.partition_bytes == 1_000_000
    assert config.credit_bytes == 8 * 1024**2
    assert config.timeline == "/tmp/trace.json"
    assert config.log_level == 10
    assert config.timeout == 2.5
    assert config.merge is False
    assert config.fast_lane_bytes == 64 * 1024


def test_empty_environment_values_are_ignored():
    config = resolve({name: "" for name in ENV_NAMES})
    assert config == SchedulerConfig()


def test_keywords_override_environment():
    env = {"BYTESCHEDULER_PARTITION": "1MB", "BYTESCHEDULER_CREDIT": "2MB", "BYTESCHEDULER_MERGE": "0",
           "BYTESCHEDULER_TIMEOUT": "7", "BYTESCHEDULER_DEBUG": "info", "BYTESCHEDULER_FAST_LANE": "0",
           "BYTESCHEDULER_TIMELINE": "/tmp/env.json"}
    config = resolve(env, partition_bytes="2MiB", credit_bytes=12345, merge=True, timeout=3,
                     log_level="error", fast_lane_bytes="1KB", timeline=pathlib.Path("/tmp/kw.json"))
    assert config.partition_bytes == 2 * 1024**2
    assert config.credit_bytes == 12345
    assert config.merge is True
    assert config.timeout == 3.0
    assert config.log_level == 40
    assert config.fast_lane_bytes == 1000
    assert config.timeline == "/tmp/kw.json" and isinstance(config.timeline, str)


def test_none_keywords_leave_environment_in_force():
    env = {"BYTESCHEDULER_PARTITION": "1MB", "BYTESCHEDULER_MERGE": "false"}
    config = resolve(env, partition_bytes=None, merge=None, timeline=None)
    assert config.partition_bytes == 1_000_000 and config.merge is False and config.timeline is None


def test_os_environ_is_the_default(monkeypatch):
    monkeypatch.setenv("BYTESCHEDULER_CREDIT", "3KiB")
    assert SchedulerConfig.resolve().credit_bytes == 3072
    assert SchedulerConfig.resolve(environ={}).credit_bytes == SchedulerConfig().credit_bytes


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="partition_size"):
        resolve(partition_size=10)


# ---------------------------------------------------------------------------- bad values


@pytest.mark.parametrize("name", ["BYTESCHEDULER_PARTITION", "BYTESCHEDULER_CREDIT"])
@pytest.mark.parametrize("value", ["big", "-1", "0", "12 parsecs"])
def test_bad_size_in_environment_names_the_variable(name, value):
    with pytest.raises(ValueError) as info:
        resolve({name: value})
    assert name in str(info.value)
    assert "4MB" in str(info.value)


def test_fast_lane_zero_turns_it_off_but_garbage_is_rejected():
    assert resolve({"BYTESCHEDULER_FAST_LANE": "0"}).fast_lane_bytes == 0
    assert resolve(fast_lane_bytes=0).fast_lane_bytes == 0
    with pytest.raises(ValueError, match="BYTESCHEDULER_FAST_LANE"):
        resolve({"BYTESCHEDULER_FAST_LANE": "-1"})
    with pytest.raises(ValueError, match="fast_lane_bytes"):
        resolve(fast_lane_bytes="fast")


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                             ("0", False), ("False", False), ("no", False), ("off", False)])
def test_merge_booleans(value, expected):
    assert resolve({"BYTESCHEDULER_MERGE": value}).merge is expected
    assert resolve(merge=value).merge is expected


def assert_rejected(variable, keyword, value, advice):
    """``value`` is refused from the environment (naming the variable and what to use) and as a keyword."""
    with pytest.raises(ValueError) as info:
        resolve({variable: value})
    assert variable in str(info.value) and advice in str(info.value)
    with pytest.raises(ValueError, match=f"{keyword}="):
        resolve(**{keyword: value})


@pytest.mark.parametrize("value", ["maybe", "2", "y", "enabled"])
def test_bad_boolean(value):
    assert_rejected("BYTESCHEDULER_MERGE", "merge", value, "true/false")


@pytest.mark.parametrize("value, expected", [("2.5", 2.5), ("10", 10.0), ("0.01", 0.01)])
def test_timeouts(value, expected):
    assert resolve({"BYTESCHEDULER_TIMEOUT": value}).timeout == expected
    assert resolve(timeout=value).timeout == expected


@pytest.mark.parametrize("value, expected", [("0", 0.0), ("2", 2.0), ("0.5", 0.5)])
def test_cycle_times(value, expected):
    assert resolve({"BYTESCHEDULER_CYCLE_TIME": value}).cycle_ms == expected
    assert resolve(cycle_ms=value).cycle_ms == expected


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "soon", "2ms"])
def test_bad_cycle_time(value):
    assert_rejected("BYTESCHEDULER_CYCLE_TIME", "cycle_ms", value, "milliseconds")


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon", "1s"])
def test_bad_timeout(value):
    assert_rejected("BYTESCHEDULER_TIMEOUT", "timeout", value, "positive number of seconds")


@pytest.mark.parametrize(
    "value, expected",
    [("1", 10), ("true", 10), ("0", None), ("", None), ("off", None), ("DEBUG", 10), ("info", 20),
     ("Warning", 30), ("warn", 30), ("ERROR", 40), ("critical", 50), ("25", 25)],
)
def test_log_levels(value, expected):
    assert resolve({"BYTESCHEDULER_DEBUG": value}).log_level == expected


@pytest.mark.parametrize("value", ["verbose", "-5", "2.5", "loud"])
def test_bad_log_level(value):
    with pytest.raises(ValueError) as info:
        resolve({"BYTESCHEDULER_DEBUG": value})
    assert "BYTESCHEDULER_DEBUG" in str(info.value) and "DEBUG" in str(info.value) and "1 (debug)" in str(info.value)
    with pytest.raises(ValueError, match="log_level="):
        resolve(log_level=value)


@pytest.mark.parametrize("option", ["partition_bytes", "credit_bytes"])
def test_bad_keyword_size_names_the_keyword(option):
    with pytest.raises(ValueError, match=option):
        resolve(**{option: "huge"})
    with pytest.raises(ValueError, match=option):
        resolve(**{option: True})
    with pytest.raises(ValueError, match=option):
        resolve(**{option: 0})


# ---------------------------------------------------------------------------- the scheduler's config


def test_scheduler_reads_environment_and_keywords(monkeypatch):
    monkeypatch.setenv("BYTESCHEDULER_PARTITION", "100")
    monkeypatch.setenv("BYTESCHEDULER_MERGE", "0")
    backend = FakeBackend("immediate")
    with Scheduler(backend, credit_bytes="1KB") as s:
        assert s.config.partition_bytes == 100 and s.config.merge is False and s.config.credit_bytes == 1000
        s.submit(make_task(0, 250)).result(timeout=WAIT)
    assert [r.nbytes for r in backend.ops] == [100, 100, 50]


def test_scheduler_rejects_bad_environment(monkeypatch):
    monkeypatch.setenv("BYTESCHEDULER_CREDIT", "plenty")
    with pytest.raises(ValueError, match="BYTESCHEDULER_CREDIT"):
        Scheduler(FakeBackend("immediate"))


def test_scheduler_with_explicit_config_ignores_environment(monkeypatch):
    monkeypatch.setenv("BYTESCHEDULER_PARTITION", "100")
    config = SchedulerConfig(partition_bytes=1000, merge=False)
    with Scheduler(FakeBackend("immediate"), config=config) as s:
        assert s.config == config


def test_scheduler_config_plus_keyword_keeps_the_rest_of_the_config(monkeypatch, tmp_path):
    """Passing a config and one keyword must change that keyword only.

    Fields the explicit config leaves at None (timeline, log_level) must not be taken from
    the environment just because a keyword was also given.
    """
    monkeypatch.setenv("BYTESCHEDULER_PARTITION", "100")
    monkeypatch.setenv("BYTESCHEDULER_TIMELINE", str(tmp_path / "from-env.json"))
    config = SchedulerConfig(partition_bytes=1000, credit_bytes=5000, timeout=9.0)
    s = Scheduler(FakeBackend("immediate"), config=config, merge=False)
    try:
        assert s.config == dataclasses.replace(config, merge=False)
    finally:
        s.stop()
    assert os.listdir(tmp_path) == []


def test_adapter_defaults_sit_below_environment_and_keywords():
    from bytescheduler.core import SchedulerConfig

    defaults = SchedulerConfig(partition_bytes=64 * 2**20, credit_bytes=256 * 2**20)
    assert SchedulerConfig.resolve(environ={}, defaults=defaults).partition_bytes == 64 * 2**20
    env = {"BYTESCHEDULER_PARTITION": "1MiB"}
    assert SchedulerConfig.resolve(environ=env, defaults=defaults).partition_bytes == 2**20
    assert SchedulerConfig.resolve(environ=env, defaults=defaults, partition_bytes=512).partition_bytes == 512
    assert SchedulerConfig.resolve(environ=env, defaults=defaults).credit_bytes == 256 * 2**20


def test_every_value_records_where_it_came_from(tmp_path):
    """A plan, the environment and keywords stack in that order, and each value says which set it."""
    plan = tmp_path / "plan.json"
    plan.write_text('{"format": "bytescheduler-plan", "version": 1, "schedule": false, '
                    '"partition_bytes": 1024, "credit_bytes": 4096}')
    defaults = SchedulerConfig(partition_bytes=64 * 2**20, adaptive=True)
    env = {"BYTESCHEDULER_CREDIT": "8KiB", "BYTESCHEDULER_PLAN": str(plan)}
    config = SchedulerConfig.resolve(environ=env, defaults=defaults, timeout=30)
    assert (config.partition_bytes, config.credit_bytes, config.timeout, config.start_plain) == (1024, 8192, 30.0, True)
    assert {name: config.source(name) for name in ("partition_bytes", "credit_bytes", "timeout", "start_plain",
                                                   "plan", "adaptive", "merge")} == {
        "partition_bytes": "plan", "credit_bytes": "environment", "timeout": "argument", "start_plain": "plan",
        "plan": "environment", "adaptive": "default", "merge": "default"}
    assert config.given("partition_bytes") and not config.given("adaptive")
    # An adapter's defaults are defaults even though they were built with arguments.
    assert SchedulerConfig.resolve(environ={}, defaults=defaults).source("partition_bytes") == "default"
    # Built directly, what differs from the class's defaults counts as an argument; options on top too.
    direct = SchedulerConfig(credit_bytes=8, merge=True)
    assert (direct.source("credit_bytes"), direct.source("merge")) == ("argument", "default")
    assert SchedulerConfig.build(direct, partition_bytes="4KiB").source("partition_bytes") == "argument"
    # Provenance is not part of a config's value: equal settings are equal configs, and it survives pickling.
    assert config == dataclasses.replace(config, sources={}) and hash(config) == hash(dataclasses.replace(config, sources={}))
    import pickle
    assert pickle.loads(pickle.dumps(config)).source("credit_bytes") == "environment"
    with pytest.raises(KeyError, match="credit_bytes"):
        config.source("credit")
