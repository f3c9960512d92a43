"""The byte budget of HTTP request bodies over many error responses: every request,
answered or refused, gives back its share, so errors never starve the requests after
them (issue 34: a budget released only on success let through this bug)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest

from aiodla.serve import Server
from aiodla.serve._http import budget_for
from aiodla.testing import EngineFactory

from support import X, affine_model, expected_affine

pytestmark = pytest.mark.asyncio

# Each a 400 once its body is read: not JSON, no inputs, a wrong shape.
BAD_BODIES = (
    b'{"inputs": [',
    b'{"inputs": []}',
    json.dumps({"inputs": [{"name": "x", "datatype": "FP16", "shape": [1], "data": [1]}]}).encode(),
)


async def chunked(body: bytes) -> AsyncIterator[bytes]:
    """A body sent without a Content-Length: the server reserves the whole limit for it."""
    yield body


async def test_error_responses_give_back_their_share_of_the_budget(
    aiodla_engine: EngineFactory,
) -> None:
    engine = await aiodla_engine(affine_model())
    async with Server({"affine": engine}, http="127.0.0.1:0") as server:
        limit = server.max_request_bytes
        # As many errors as the budget has shares of a body of unknown length: a share
        # kept by each would leave the next request waiting for good.
        errors = budget_for(limit) // limit
        url = f"http://127.0.0.1:{server.http_port}/v2/models/affine/infer"
        async with aiohttp.ClientSession() as session:
            for i in range(errors):
                body = BAD_BODIES[i % len(BAD_BODIES)]
                async with session.post(url, data=chunked(body)) as response:
                    assert response.status == 400, await response.text()
                    assert "error" in await response.json()
            x = np.arange(np.prod(X.shape), dtype=np.float16).reshape(X.shape) / 16
            tensor = {"name": "x", "datatype": "FP16", "shape": list(X.shape)}
            request = {"inputs": [{**tensor, "data": x.ravel().tolist()}]}

            async def served() -> tuple[int, dict[str, object]]:
                async with session.post(url, json=request) as response:
                    return response.status, await response.json()

            status, answer = await asyncio.wait_for(served(), 10)
        assert status == 200, answer
        (output,) = answer["outputs"]  # type: ignore[misc]
        y = np.asarray(output["data"], np.float32).reshape(output["shape"])
        np.testing.assert_array_equal(y, expected_affine(x))
        assert server.statistics().failed == {"INVALID_ARGUMENT": errors}
