"""The byte budget of HTTP request bodies over many error responses: every request,
answered or refused, gives back its share, so errors never starve the requests after
them (issue 34: a budget released only on success let through this bug). The budget
holds four of the largest bodies the served models take, 256 MiB at least."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from aiodla.serve import Server
from aiodla.serve._http import MIB, budget_for
from aiodla.testing import EngineFactory

from support import X, affine_model, expected_affine

# Each a 400 once its body is read (padded to the size tested): not JSON, no inputs,
# a wrong shape.
BAD_BODIES = (
    b'{"inputs": [',
    b'{"inputs": []}',
    json.dumps({"inputs": [{"name": "x", "datatype": "FP16", "shape": [1], "data": [1]}]}).encode(),
)


@pytest.mark.asyncio
async def test_error_responses_give_back_their_share_of_the_budget(
    aiodla_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiodla.serve import _http

    # A budget of four bodies of the largest size (the tiny model takes 1 MiB).
    monkeypatch.setattr(_http, "MIN_BUDGET_BYTES", 4 * 1024 * 1024)
    engine = await aiodla_engine(affine_model())
    async with Server({"affine": engine}, http="127.0.0.1:0", grpc=None) as server:
        limit = server.max_request_bytes
        # As many refused bodies of the largest size as the budget holds: the bytes of
        # one kept by each would leave the next request waiting for good.
        errors = _http.budget_for(limit) // limit
        assert errors == 4
        url = f"http://127.0.0.1:{server.http_port}/v2/models/affine/infer"
        async with aiohttp.ClientSession() as session:
            for i in range(errors):
                body = BAD_BODIES[i % len(BAD_BODIES)]
                body += b" " * (limit - len(body))
                async with session.post(url, data=body) as response:
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


@pytest.mark.parametrize(
    ("limit", "budget"),
    [(MIB, 256 * MIB), (64 * MIB, 256 * MIB), (100 * MIB, 400 * MIB)],
    ids=["floor", "four-at-the-floor", "four"],
)
def test_the_budget_holds_four_of_the_largest_bodies(limit: int, budget: int) -> None:
    assert budget_for(limit) == budget
