"""aiodla._errors: the exception tree holds on every supported Python.

On 3.10, ``asyncio.TimeoutError`` is a class apart from the builtin ``TimeoutError``
(3.11 made them one), and code written for 3.10 catches the asyncio one.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiodla
from aiodla import EmulatedRuntime, Engine, RequestTimeoutError

from support import X


class TestRequestTimeoutError:
    def test_is_a_timeout_error_of_both_kinds(self) -> None:
        assert issubclass(RequestTimeoutError, aiodla.AiodlaError)
        assert issubclass(RequestTimeoutError, TimeoutError)
        assert issubclass(RequestTimeoutError, asyncio.TimeoutError)

    @pytest.mark.asyncio
    async def test_an_infer_timeout_is_caught_as_asyncio_timeout_error(
        self, engine: Engine, runtime: EmulatedRuntime
    ) -> None:
        gates = [runtime.hold(0), runtime.hold(1)]
        caught: BaseException | None = None
        try:
            await engine.infer(np.ones(X.shape, np.float32), timeout=0)
        except asyncio.TimeoutError as exc:  # the spelling code written for 3.10 uses
            caught = exc
        assert isinstance(caught, RequestTimeoutError)
        for gate in gates:
            gate.release()
