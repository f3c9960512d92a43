"""What the HTTP front answers beside inference, read off the wire: a route not served
and a method not allowed (JSON, with ``Allow``), readiness once an engine died, the
Prometheus content type of ``/metrics``, and the 413 of a chunked body."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest

from aiodla.serve import Server
from aiodla.testing import DLAControls, EngineFactory

from support import affine_model

pytestmark = pytest.mark.asyncio


async def get(server: Server, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    url = f"http://127.0.0.1:{server.http_port}{path}"
    async with aiohttp.ClientSession() as session, session.request(method, url) as response:
        return response.status, dict(response.headers), await response.read()


async def test_a_route_not_served_is_json_404(server: Server) -> None:
    status, headers, body = await get(server, "/v2/nowhere")
    assert status == 404 and headers["Content-Type"].startswith("application/json")
    assert int(headers["Content-Length"]) == len(body)
    assert json.loads(body) == {"error": "Not Found: GET /v2/nowhere is not served"}


async def test_a_method_not_allowed_is_json_405_with_allow(server: Server) -> None:
    status, headers, body = await get(server, "/v2/models/affine/infer", "GET")
    assert status == 405 and headers["Content-Type"].startswith("application/json")
    assert headers["Allow"] == "POST"
    assert int(headers["Content-Length"]) == len(body)
    error = json.loads(body)["error"]
    assert error == "Method Not Allowed: GET /v2/models/affine/infer is not served"


async def test_metrics_are_prometheus_text(server: Server) -> None:
    from prometheus_client import CONTENT_TYPE_LATEST

    status, headers, body = await get(server, "/metrics")
    assert status == 200
    # The text exposition format, as scrapers negotiate it (not a download).
    assert headers["Content-Type"] == CONTENT_TYPE_LATEST
    assert CONTENT_TYPE_LATEST.startswith("text/plain; version=")
    assert b"nv_inference_request_success" in body


async def test_not_ready_once_an_engine_died(
    aiodla_engine: EngineFactory, aiodla_controls: DLAControls
) -> None:
    engine = await aiodla_engine(affine_model())
    async with Server({"affine": engine}, http="127.0.0.1:0", grpc=None) as server:
        assert (await get(server, "/v2/health/ready"))[0] == 200
        aiodla_controls.poison()
        with pytest.raises(Exception):  # noqa: B017, PT011  (the request that meets the poison)
            await engine.infer(np.zeros((1, 3, 8, 8), np.float16))
        assert engine.dead
        assert (await get(server, "/v2/health/ready"))[0] == 503
        assert (await get(server, "/v2/models/affine/ready"))[0] == 503
        assert (await get(server, "/v2/health/live"))[0] == 200


async def test_a_chunked_body_over_the_limit_names_the_body(server: Server) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b" " * (512 * 1024)

    url = f"http://127.0.0.1:{server.http_port}/v2/models/affine/infer"
    async with aiohttp.ClientSession() as session, session.post(url, data=chunks()) as response:
        assert response.status == 413
        error = (await response.json())["error"]
    limit = server.max_request_bytes
    assert error == (
        f"the request body is larger than the {limit} bytes the served models' inputs take"
    )
