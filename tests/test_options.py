"""Engine options: every bad value is refused by name, in one place."""

from __future__ import annotations

import pytest

from aiodla import ConfigurationError, Engine, EngineClosedError, EngineOptions

from support import affine_model


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"cores": 0}, "cores=0"),
        ({"cores": []}, "one or more"),
        ({"cores": [0, 0]}, "twice"),
        ({"cores": [-1]}, "ints >= 0"),
        ({"cores": ["0"]}, "ints >= 0"),
        ({"streams_per_core": 0}, "streams_per_core=0 must be an int in [1, 16]"),
        ({"streams_per_core": 17}, "streams_per_core=17"),
        ({"streams_per_core": 2.0}, "streams_per_core=2.0"),
        ({"max_queue": -1}, "max_queue=-1"),
        ({"task_timeout": 0}, "task_timeout=0"),
        ({"task_timeout": 2000}, "task_timeout=2000"),
        ({"task_timeout": float("nan")}, "task_timeout=nan"),
        ({"close_timeout": -1}, "close_timeout=-1"),
        ({"scales": {"x": 0}}, "scales['x']=0"),
        ({"scales": {"x": float("inf")}}, "scales['x']=inf"),
        ({"offload_bytes": -5}, "offload_bytes=-5"),
        ({"latency_window": 0}, "latency_window=0"),
    ],
)
def test_bad_options_are_named(options: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Engine(affine_model(), **options)  # type: ignore[arg-type]
    assert words in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_options_are_frozen_and_normalized() -> None:
    options = EngineOptions(cores=[1, 0], scales={"x": 1})  # type: ignore[arg-type]
    assert options.cores == (1, 0)
    assert options.scales == {"x": 1.0}
    with pytest.raises(AttributeError):
        options.cores = (0,)  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.scales["y"] = 2.0  # type: ignore[index]


def test_engine_exposes_its_options() -> None:
    engine = Engine(affine_model(), cores=[1], streams_per_core=4, max_queue=7, task_timeout=0.5)
    assert engine.options.cores == (1,)
    assert engine.options.streams_per_core == 4
    assert engine.options.max_queue == 7
    assert engine.options.task_timeout == 0.5


def test_an_unknown_engine_keyword_names_the_nearest_option() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"unknown engine option 'stream_per_core'.*did you mean 'streams_per_core'",
    ):
        Engine(affine_model(), stream_per_core=4)
    with pytest.raises(ConfigurationError, match="unknown engine option 'zzz'; options are"):
        Engine(affine_model(), zzz=1)


def test_engine_keywords_take_the_options_defaults() -> None:
    assert Engine(affine_model()).options == EngineOptions()


@pytest.mark.asyncio
async def test_the_runtime_and_the_stated_service_time_are_known_once_open() -> None:
    engine = Engine(affine_model(latency=0.002), runtime="emulated")
    with pytest.raises(EngineClosedError, match="runtime is not chosen yet"):
        engine.runtime  # noqa: B018
    assert engine.stated_service_time is None
    async with engine:
        assert engine.runtime.name == "emulated"
        assert engine.stated_service_time == 0.002
