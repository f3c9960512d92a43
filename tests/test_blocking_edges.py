"""BlockingEngine's edges that mutation testing found untested (issue 44): the errors
name the call that was refused and the way out, ``infer_future`` keeps its timeout, and
the warning about an engine left open points at the engine."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import warnings
import weakref
from typing import Any

import numpy as np
import pytest
from test_blocking import in_a_forked_child

import aiodla
from aiodla import (
    AiodlaError,
    BlockingEngine,
    ConfigurationError,
    DeviceTensor,
    EngineClosedError,
    RequestTimeoutError,
)
from aiodla.testing import DLAControls

from support import X, affine_model, counts_add_up, expected_affine


def frame() -> np.ndarray[Any, Any]:
    return np.random.default_rng(7).standard_normal(X.shape).astype(np.float32)


class TestRefusalsNameTheCall:
    """A blocking call made on a running event loop is refused by an error that starts
    with the call refused, so a program with several of them can tell which."""

    def test_infer_and_close_on_a_running_loop_each_say_which(self) -> None:
        with BlockingEngine(affine_model(), cores=[0]) as engine:

            async def inside() -> list[str]:
                said = []
                other = BlockingEngine(affine_model())
                for call in (lambda: engine.infer(frame()), engine.close, other.open):
                    with pytest.raises(AiodlaError) as caught:
                        call()
                    said.append(str(caught.value))
                return said

            said = asyncio.run(inside())
            assert not engine.closed  # the refused close did nothing
        advice = (
            " would block this thread's running event loop (and deadlock if it is the "
            "engine's); in async code use 'async with aiodla.Engine(...)' and "
            "'await engine.infer(x)', or call from another thread (asyncio.to_thread)"
        )
        assert said == [
            "BlockingEngine.infer" + advice,
            "closing a BlockingEngine" + advice,
            "opening a BlockingEngine" + advice,
        ]

    def test_not_open_and_closed_say_what_to_do(self) -> None:
        engine = BlockingEngine(affine_model(), cores=[0])
        not_open = re.escape(
            "the engine is not open; use 'with BlockingEngine(...)' or engine.open()"
        )
        with pytest.raises(EngineClosedError, match=f"^{not_open}$"):
            engine.infer(frame())
        engine.open()
        engine.close()
        with pytest.raises(EngineClosedError, match=r"^the engine is closed$"):
            engine.infer_future(frame())


class TestOpenOnce:
    def test_open_twice_and_reopen_are_refused_by_name(self) -> None:
        engine = BlockingEngine(affine_model(), cores=[0])
        with engine:
            with pytest.raises(AiodlaError, match=r"^the engine is open; open it once$"):
                engine.open()
            np.testing.assert_array_equal(engine.infer(frame()), expected_affine(frame()))
        with pytest.raises(
            EngineClosedError, match=r"^Cannot reopen an engine once it has been closed\.$"
        ):
            engine.open()

    def test_a_failed_open_leaves_the_engine_closed(self) -> None:
        engine = BlockingEngine(b"not a loadable", runtime="emulated")
        with pytest.raises(aiodla.RuntimeUnavailableError):
            engine.open()
        assert engine.closed
        with pytest.raises(EngineClosedError, match="reopen"):
            engine.open()


class TestInferFutureTimeout:
    def test_infer_future_keeps_its_timeout(self) -> None:
        controls = DLAControls(2)
        with BlockingEngine(affine_model(), cores=[0], runtime=controls.runtime) as engine:
            with controls.hold(0):
                future = engine.infer_future(frame(), timeout=0.01)
                assert isinstance(future.exception(timeout=10), RequestTimeoutError)
            stats = engine.statistics()
        assert stats.timed_out == 1 and counts_add_up(stats)
        controls.close()
        assert controls.leak_report() is None


class TestOutputs:
    def test_output_device_reaches_the_engine(self) -> None:
        x = frame()
        with BlockingEngine(affine_model(), runtime="emulated") as engine:
            y = engine.infer_future(x, output="device").result(timeout=10)
            with pytest.raises(ConfigurationError, match="'host' or 'device'"):
                engine.infer(x, output="gpu")
        assert isinstance(y, DeviceTensor)
        np.testing.assert_array_equal(y.to_host(), expected_affine(x))

    def test_a_result_handed_back_is_not_kept_by_the_engine(self) -> None:
        with BlockingEngine(affine_model(), cores=[0]) as engine:
            results = [weakref.ref(engine.infer(frame())) for _ in range(5)]
            gc.collect()
            # Each request's result lives as long as its caller keeps it, no longer.
            assert [ref() for ref in results] == [None] * 5


class TestUnclosedWarningSource:
    def test_the_unclosed_warning_names_the_engine_as_its_source(self) -> None:
        # The source is what tracemalloc (python -X tracemalloc) shows the allocation of.
        engine = BlockingEngine(affine_model(), cores=[0])
        engine.open()
        inner = engine.engine
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del engine
            gc.collect()
        unclosed = [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert len(unclosed) == 1
        assert isinstance(unclosed[0].source, BlockingEngine)
        assert unclosed[0].source.engine is inner
        assert inner.state.value == "closed"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
class TestForkedChildAdvice:
    def test_the_child_is_told_what_to_do_and_its_closed_copy_says_closed(self) -> None:
        with BlockingEngine(affine_model(), cores=[0]) as engine:
            engine.infer(frame())  # the parent served before the fork

            def child() -> str:
                said = []
                try:
                    engine.infer(frame())
                except AiodlaError as exc:
                    said.append(str(exc))
                try:
                    engine.open()  # already open, in the parent
                except AiodlaError as exc:
                    said.append(str(exc))
                engine.close()
                try:
                    engine.infer(frame())
                except EngineClosedError as exc:
                    said.append(str(exc))
                return "\n".join(said)

            status, said = in_a_forked_child(child)
        assert status == 0, said
        refused, opening, closed = said.splitlines()
        assert opening == refused
        assert refused.endswith(
            "so it cannot run requests: open a new BlockingEngine in the child, or start "
            "the child with the 'spawn' method"
        )
        assert closed == "the engine is closed"
