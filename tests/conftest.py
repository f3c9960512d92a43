"""Shared fixtures: emulated models and engines, and the event-loop variants.

Tests marked ``loop_variants`` run on every event loop available here: plain asyncio
in debug mode, uvloop where installed, and asyncio with eager tasks on Python 3.12+.
The rest run on plain asyncio in debug mode.

``AIODLA_TEST_ISOLATION=process`` runs every engine a test opens on the emulated
runtime with ``isolation="process"`` instead (its runtime in a worker process): the
engine tests then check that both modes behave alike. The controls of aiodla.testing's runtime
(the ``runtime`` and ``leaky_runtime`` fixtures) then act in the engine's worker; see
tests/test_isolation.py for the process mode's own tests.

Hypothesis runs the ``derandomized`` profile unless told otherwise: the same examples
every run, so a failure reproduces and a pass means the same thing in CI as here (the
inputs that matter most are pinned with ``@example`` besides). The random search runs
with ``--hypothesis-profile=random`` or ``AIODLA_HYPOTHESIS_PROFILE=random``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from hypothesis import settings

from aiodla import EmulatedRuntime, Engine, EngineState
from aiodla.testing import DLAControls, EngineFactory

from support import HeldRequest, X, affine_model, counts_add_up, slots_not_back

# Through pytest_plugins rather than the entry point (pyproject's addopts disables
# that), so pytest-cov measures aiodla from its first import.
pytest_plugins = ["aiodla.testing.plugin"]

LoopFactory = Callable[[], asyncio.AbstractEventLoop]

# Derandomized: examples from a seed fixed per test, and no example database, so a run
# does not depend on what earlier runs on this machine found. The pytest plugin's
# --hypothesis-profile, read after this file, wins over the environment variable.
settings.register_profile("derandomized", derandomize=True, database=None, print_blob=True)
settings.register_profile("random", print_blob=True)
settings.load_profile(os.environ.get("AIODLA_HYPOTHESIS_PROFILE", "derandomized"))


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


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, LoopFactory]:
    if item.get_closest_marker("loop_variants") is not None:
        return _loop_variants()
    return {"asyncio": _debug_loop}


ISOLATION = os.environ.get("AIODLA_TEST_ISOLATION", "thread")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ISOLATION != "process":
        return
    skip = pytest.mark.skip(reason="in-process only (the comment above the test says why)")
    for item in items:
        if item.get_closest_marker("in_process") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolation_mode(monkeypatch: pytest.MonkeyPatch) -> str:
    """With AIODLA_TEST_ISOLATION=process, an engine made on the emulated runtime (by
    name or instance) runs it in a worker process instead."""
    if ISOLATION == "process":
        init = Engine.__init__

        def in_a_worker(self: Engine, model: object, **kwargs: object) -> None:
            runtime = kwargs.get("runtime", "auto")
            if isinstance(runtime, EmulatedRuntime) or runtime in ("auto", "emulated"):
                kwargs.setdefault("isolation", "process")
                # An instance cannot cross processes; aiodla.testing's controlled one
                # reaches the worker's runtime instead (its controls are forwarded).
                controlled = hasattr(runtime, "attach_worker")
                if kwargs["isolation"] == "process" and not isinstance(runtime, str):
                    kwargs["runtime"] = runtime if controlled else "emulated"
            init(self, model, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Engine, "__init__", in_a_worker)
    return ISOLATION


@pytest.fixture(autouse=True)
def everything_given_back(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Fail the test that leaks a slot or a handle, whichever test it is.

    At each ``aclose`` of an open, in-process engine on an emulated runtime
    (``async with``, the fixtures, ``BlockingEngine`` alike):

    - before the close, which would give a lost slot's memory back and hide it: each
      busy slot belongs to a request in flight or to a task the DLA has not finished
      (``support.slots_not_back``: the engine's statistics, the emulated DLA's count);
    - after it, for a lone engine that made its runtime (``runtime="emulated"``, no
      shared ``Cores``): the close gave back at least as many handles of each kind (devices, modules,
      registrations, streams, events, device and host memory, graphs) as the open
      took. (Frame buffers, made later, go with their last array; memory a test makes
      on the runtime is the test's.) A runtime the test passed in has its handles
      counted by the test (``aiodla_controls`` does).

    An engine that died, one in a worker process, and the tests that keep a slot and
    its handles on purpose (a hung core's, a retired slot's: ``leaky_runtime``) are
    not checked. Costs a ``statistics()`` and a few handle counts per open and close.
    """
    if "leaky_runtime" in request.fixturenames:
        yield
        return
    problems: list[str] = []
    # What each engine that made its runtime took at open, by kind of handle.
    taken: weakref.WeakKeyDictionary[Engine, dict[str, int]] = weakref.WeakKeyDictionary()
    init, open_, aclose = Engine.__init__, Engine.open, Engine.aclose

    # functools.wraps: tests that read Engine's signatures see the real ones.
    @functools.wraps(init)
    def recording_init(self: Engine, model: Any, **options: Any) -> None:
        init(self, model, **options)
        # A lone engine (cores by number, not a shared Cores) that made its runtime.
        lone = isinstance(options.get("cores", ()), (list, tuple, range))
        if lone and isinstance(options.get("runtime", "auto"), str):
            taken[self] = {}

    @functools.wraps(open_)
    async def recording_open(self: Engine) -> None:
        await open_(self)
        runtime = _in_process_emulated(self)
        if runtime is not None and self in taken:
            taken[self] = runtime.live_handles()  # (a runtime of its own: all its)

    @functools.wraps(aclose)
    async def checked_aclose(self: Engine) -> None:
        runtime = _in_process_emulated(self)
        if runtime is None or self.state is not EngineState.OPEN:
            await aclose(self)
            return
        leaked = await slots_not_back(self, runtime)
        if leaked is not None:
            problems.append(leaked)
        before = runtime.live_handles()
        await aclose(self)
        after = runtime.live_handles()
        kept = {
            kind: count - (before[kind] - after[kind])
            for kind, count in taken.get(self, {}).items()
            if before[kind] - after[kind] < count
        }
        if kept:
            problems.append(f"{self!r} kept handles its open took: {kept}")

    monkeypatch.setattr(Engine, "__init__", recording_init)
    monkeypatch.setattr(Engine, "open", recording_open)
    monkeypatch.setattr(Engine, "aclose", checked_aclose)
    yield
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


def _in_process_emulated(engine: Engine) -> EmulatedRuntime | None:
    """The engine's emulated runtime, when it runs in this process."""
    if engine.options.isolation != "thread" or engine.state is not EngineState.OPEN:
        return None
    runtime = engine.runtime
    return runtime if isinstance(runtime, EmulatedRuntime) else None


@pytest.fixture
def runtime(aiodla_controls: DLAControls) -> EmulatedRuntime:
    """The emulated DLA of aiodla.testing's controls: a test that leaves a handle alive
    fails at teardown (the project's own tests use the fixtures its users get)."""
    return aiodla_controls.runtime


@pytest.fixture
def leaky_runtime() -> Iterator[EmulatedRuntime]:
    """A runtime for the tests that leave handles alive on purpose (a hung core's):
    aiodla.testing's, with no check for leaks at the end."""
    controls = DLAControls(2)
    yield controls.runtime
    controls.close()


@pytest_asyncio.fixture
async def held_offloaded_request(
    aiodla_engine: EngineFactory, aiodla_controls: DLAControls
) -> AsyncIterator[HeldRequest]:
    """One request on the DLA, held there (``gate``), on an engine of one slot (core 0,
    one stream) whose every packing and unpacking runs in a worker thread
    (``offload_bytes=0``); hold anyio's thread tokens (``support.NoThreads``) to stop it
    between its steps. The gate is released at the latest when the test ends."""
    engine = await aiodla_engine(affine_model(), cores=[0], streams_per_core=1, offload_bytes=0)
    with aiodla_controls.hold(0) as gate:
        task = asyncio.ensure_future(engine.infer(np.ones(X.shape, np.float32)))
        await gate.reached(1)  # packed (in a thread) and submitted
        yield HeldRequest(engine, gate, task)


@pytest_asyncio.fixture
async def engine(aiodla_engine: EngineFactory, runtime: EmulatedRuntime) -> AsyncIterator[Engine]:
    opened = await aiodla_engine(affine_model())
    assert ISOLATION == "process" or opened.runtime is runtime
    yield opened
    await opened.aclose()
    assert all(count == 0 for count in runtime.live_handles().values()), runtime.live_handles()


@pytest.fixture
def engines_add_up(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Engine]]:
    """Every engine the test makes: its counts must add up when the test ends."""
    made: list[Engine] = []
    init = Engine.__init__

    def recording_init(self: Engine, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    yield made
    for engine in made:
        stats = engine.statistics()
        assert counts_add_up(stats), f"the counts do not add up: {stats}"
