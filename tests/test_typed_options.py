"""Engine's options are typed keywords: ``**options: Unpack[EngineKeywords]`` names
every EngineOptions field with its type (so ``mypy --strict`` refuses a misspelt or
mistyped option: tests/test_tooling.py), and the worker process's settings come grouped
in one ProcessIsolation."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import aiodla
from aiodla import ConfigurationError, Engine, EngineKeywords, EngineOptions, ProcessIsolation

from support import affine_model

_GROUPED = {field.name for field in dataclasses.fields(ProcessIsolation)}


def test_every_option_is_a_typed_keyword() -> None:
    fields = {field.name for field in dataclasses.fields(EngineOptions)}
    assert set(EngineKeywords.__annotations__) == fields - _GROUPED
    assert not EngineKeywords.__required_keys__  # each keyword has the options' default
    parameters = inspect.signature(Engine.__init__).parameters
    (rest,) = [p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert rest.annotation == "Unpack[EngineKeywords]"
    assert {"EngineKeywords", "ProcessIsolation"} <= set(aiodla.__all__)


def test_process_isolation_is_exported_and_grouped() -> None:
    settings = ProcessIsolation(max_restarts=2, restart_window=3.0, heartbeat_timeout=0.5)
    options = Engine(affine_model(), isolation=settings).options
    assert options.isolation is settings  # kept whole, not flattened into fields
    assert options.process_isolation is settings
    assert not {"max_restarts", "restart_window", "heartbeat_timeout"} & {
        f.name for f in dataclasses.fields(options)
    }


def test_process_means_the_default_settings() -> None:
    options = Engine(affine_model(), isolation="process").options
    assert options.process_isolation == ProcessIsolation()
    assert Engine(affine_model()).options.process_isolation is None


@pytest.mark.parametrize("name", sorted(_GROUPED))
def test_a_flat_process_setting_points_to_process_isolation(name: str) -> None:
    with pytest.raises(
        ConfigurationError,
        match=rf"{name} is a setting of the worker process: pass "
        rf"isolation=aiodla\.ProcessIsolation\({name}=\.\.\.\)",
    ):
        Engine(affine_model(), isolation="process", **{name: 1})  # type: ignore[arg-type]


def test_a_misspelt_process_setting_is_pointed_to_process_isolation() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"unknown engine option 'max_restart'; did you mean "
        r"isolation=aiodla\.ProcessIsolation\(max_restarts=\.\.\.\)\?",
    ):
        Engine(affine_model(), max_restart=3)  # type: ignore[arg-type]


def test_the_options_listed_are_engine_keywords() -> None:
    with pytest.raises(ConfigurationError, match="options are") as caught:
        Engine(affine_model(), zzz=1)  # type: ignore[arg-type]
    assert "'streams_per_core'" in str(caught.value)
    assert not _GROUPED.intersection(str(caught.value).split("'"))


def test_process_isolation_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ProcessIsolation().max_restarts = 9  # type: ignore[misc]
