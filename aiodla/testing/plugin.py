"""aiodla's pytest plugin: the fixtures documented in :mod:`aiodla.testing`.

pytest loads it through the ``pytest11`` entry point in every session where aiodla is
installed, so it only defines fixtures: no hooks, no options, nothing that runs unless
a test asks for ``aiodla_controls`` or ``aiodla_engine``. Disable it with
``-p no:aiodla``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, NoReturn

import pytest

from ._controls import DLAControls, EngineFactory

__all__ = ["aiodla_controls", "aiodla_engine"]

EMULATED_CORES = 2  # Jetson AGX Orin's DLA cores


@pytest.fixture
def aiodla_controls() -> Iterator[DLAControls]:
    """An emulated DLA with two cores and its test controls; at teardown, fails the
    test if an engine opened on it left a handle alive."""
    controls = DLAControls(EMULATED_CORES)
    yield controls
    controls.close()
    report = controls.leak_report()
    if report is not None:
        pytest.fail(f"aiodla_controls: {report}", pytrace=False)


def _engine_fixture() -> Any:
    try:
        import pytest_asyncio
    except ImportError:  # the fixture then says what is missing, when a test asks for it

        @pytest.fixture(name="aiodla_engine")
        def needs_pytest_asyncio() -> NoReturn:
            pytest.fail(
                "the aiodla_engine fixture needs pytest-asyncio: pip install pytest-asyncio",
                pytrace=False,
            )

        return needs_pytest_asyncio

    @pytest_asyncio.fixture(name="aiodla_engine")
    async def engine_factory(aiodla_controls: DLAControls) -> AsyncIterator[EngineFactory]:
        """``await aiodla_engine(spec, ...)``: an open engine on ``aiodla_controls``'s
        emulated DLA; every engine it opened is closed at teardown."""
        factory = EngineFactory(aiodla_controls)
        try:
            yield factory
        finally:
            await factory.aclose()

    return engine_factory


aiodla_engine = _engine_fixture()
