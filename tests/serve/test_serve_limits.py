"""What a request may cost the server: large JSON is parsed and written off the event
loop, a body larger than the served models take is refused (413 / RESOURCE_EXHAUSTED)
before it is read, and the bodies held at once share a byte budget."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from clients import Client, failure

from aiodla import Engine, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.serve import Server
from aiodla.testing import EngineFactory

pytestmark = pytest.mark.asyncio

# One float32 frame: 307,200 values, about 6 MiB as JSON.
FRAME = TensorSpec("x", (1, 3, 320, 320), "float32", "nchw")


@pytest_asyncio.fixture
async def frame_server(aiodla_engine: EngineFactory) -> AsyncIterator[tuple[Server, Engine]]:
    out = TensorSpec("y", FRAME.shape, "float32", "nchw")
    engine = await aiodla_engine(make_loadable([FRAME], [out], "affine", 0.001, scale=2.0))
    async with Server({"frame": engine}, http="127.0.0.1:0", grpc="127.0.0.1:0") as server:
        yield server, engine


def frame_request(x: np.ndarray[Any, Any], *, json_in: bool, json_out: bool) -> tuple[bytes, dict]:
    """The body and headers of an HTTP inference request for the frame model."""
    tensor: dict[str, Any] = {"name": "x", "datatype": "FP32", "shape": list(FRAME.shape)}
    parameters = {"binary_data_output": not json_out}
    if json_in:
        tensor["data"] = x.ravel().tolist()
        return json.dumps({"inputs": [tensor], "parameters": parameters}).encode(), {}
    tensor["parameters"] = {"binary_data_size": x.nbytes}
    header = json.dumps({"inputs": [tensor], "parameters": parameters}).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


@pytest.mark.parametrize(("json_in", "json_out"), [(True, False), (False, True)])
async def test_large_json_does_not_stall_the_event_loop(
    frame_server: tuple[Server, Engine], json_in: bool, json_out: bool
) -> None:
    """A health probe is answered promptly while a 6 MiB JSON request is parsed, or a
    6 MiB JSON answer written: neither runs as one long call on the loop."""
    server, engine = frame_server
    x = np.random.default_rng(0).standard_normal(FRAME.shape).astype(np.float32)
    body, headers = frame_request(x, json_in=json_in, json_out=json_out)
    url = f"http://127.0.0.1:{server.http_port}"
    async with aiohttp.ClientSession() as probing, aiohttp.ClientSession() as asking:
        done = asyncio.Event()
        worst = 0.0

        async def probe() -> None:
            # A probe every 2 ms: a round's time is the loop's latency, a stall
            # anywhere in it (while the probe waits for its answer or its turn) included.
            nonlocal worst
            while not done.is_set():
                start = time.perf_counter()
                async with probing.get(url + "/v2/health/live") as response:
                    assert response.status == 200
                await asyncio.sleep(0.002)
                worst = max(worst, time.perf_counter() - start)

        async with probing.get(url + "/v2/health/live"):
            pass  # the probe's connection is open before timing starts
        prober = asyncio.ensure_future(probe())
        try:
            await asyncio.sleep(0.02)
            start = time.perf_counter()
            data = io.BytesIO(body)
            async with asking.post(url + "/v2/models/frame/infer", data=data, headers=headers) as r:
                answer = await r.read()
                status = r.status
            took = time.perf_counter() - start
        finally:
            done.set()
            await prober
    assert status == 200, answer[:200]
    expected = await engine.infer(x)
    if json_out:
        got = np.asarray(json.loads(answer)["outputs"][0]["data"], np.float32)
        assert got.tobytes() == expected.tobytes()
    # The loop stalls for a few milliseconds at a time at most; before, for the whole
    # parse (or write), most of the request's time.
    assert worst < 0.5 * took, (worst, took)


# -- the size of a request -------------------------------------------------------------------


async def test_a_body_over_the_limit_is_refused_before_it_is_sent(server: Server) -> None:
    """413 from the Content-Length alone: the answer comes while the body is unsent."""
    assert server.max_request_bytes == 1024 * 1024  # the tiny test models: the floor
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        writer.write(
            b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 1073741824\r\n\r\n" + b"{" + b" " * 1000
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 413 "), head
        assert b"\r\nconnection: close\r\n" in head.lower()  # the body left unread
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        error = json.loads(await reader.readexactly(length))["error"]
    finally:
        writer.close()
    assert "1073741824 bytes" in error and str(server.max_request_bytes) in error
    assert server.statistics().failed == {"RESOURCE_EXHAUSTED": 1}


async def test_a_chunked_body_over_the_limit_is_413(server: Server) -> None:
    """No Content-Length: aiohttp stops reading at the limit; its error is answered
    with its own status (not 500) and as JSON."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"inputs": []'
        for _ in range(3):
            yield b" " * (512 * 1024)
        yield b"}"

    url = f"http://127.0.0.1:{server.http_port}/v2/models/affine/infer"
    async with aiohttp.ClientSession() as session, session.post(url, data=chunks()) as response:
        assert response.status == 413
        body = await response.json()
    assert "larger than the 1048576 bytes" in body["error"]


@pytest.mark.parametrize("kind", ["grpc", "grpc_aio"])
async def test_a_grpc_message_over_the_limit_is_resource_exhausted(
    server: Server, kind: str
) -> None:
    x = np.zeros((1, 3, 512, 512), np.float16)  # 1.5 MiB: over the 1 MiB limit
    exc = await failure(Client(kind, server).infer("affine", {"x": x}))
    assert str(exc.status()) == "StatusCode.RESOURCE_EXHAUSTED", exc
