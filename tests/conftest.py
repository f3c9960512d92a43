"""Shared fixtures: emulated models and engines, and the event-loop variants.

Tests marked ``loop_variants`` run on every event loop available here: plain asyncio
in debug mode, uvloop where installed, and asyncio with eager tasks on Python 3.12+.
The rest run on plain asyncio in debug mode.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping

import pytest
import pytest_asyncio

from aiodla import EmulatedRuntime, Engine

from support import affine_model

# Through pytest_plugins rather than the entry point (pyproject's addopts disables
# that), so pytest-cov measures aiodla from its first import.
pytest_plugins = ["aiodla.testing.plugin"]

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    return loop


def _eager_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
    return loop


def _loop_variants() -> dict[str, LoopFactory]:
    variants: dict[str, LoopFactory] = {"asyncio": _debug_loop}
    try:
        import uvloop
    except ImportError:
        pass
    else:
        variants["uvloop"] = uvloop.new_event_loop
    if sys.version_info >= (3, 12):
        variants["eager"] = _eager_loop
    return variants


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, LoopFactory]:
    if item.get_closest_marker("loop_variants") is not None:
        return _loop_variants()
    return {"asyncio": _debug_loop}


@pytest.fixture
def runtime() -> Iterator[EmulatedRuntime]:
    rt = EmulatedRuntime(cores=2)
    yield rt
    rt.close()


@pytest_asyncio.fixture
async def engine(runtime: EmulatedRuntime) -> AsyncIterator[Engine]:
    async with Engine(affine_model(), runtime=runtime) as opened:
        yield opened
    assert all(count == 0 for count in runtime.live_handles().values()), runtime.live_handles()
