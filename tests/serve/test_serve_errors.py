"""Every error status of ``aiodla serve``, through HTTP and gRPC: bad input is
400 / INVALID_ARGUMENT with aiodla's message, an unknown model 404 / NOT_FOUND, a full
queue 503 / UNAVAILABLE, a passed deadline 504 / DEADLINE_EXCEEDED, a dead engine
503 / UNAVAILABLE. States are reached with aiodla.testing's controls, never by sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from clients import Client, failure, until
from conftest import int8_model, sample

from aiodla import ConfigurationError, Engine
from aiodla.serve import Server
from aiodla.testing import DLAControls, EngineFactory

from support import affine_model

pytestmark = pytest.mark.asyncio

HTTP_KINDS = ("http", "http_aio")
GRPC_KINDS = ("grpc", "grpc_aio")


def status_of(kind: str, exc: Any) -> str:
    """HTTP's status code, or gRPC's status code name."""
    status = str(exc.status())
    return status.removeprefix("StatusCode.")


@pytest_asyncio.fixture
async def small(aiodla_engine: EngineFactory) -> AsyncIterator[tuple[Server, Engine]]:
    """One affine model, one slot per core and a queue of one: easy to fill."""
    engine = await aiodla_engine(affine_model(), streams_per_core=1, max_queue=1)
    async with Server({"affine": engine}, http="127.0.0.1:0", grpc="127.0.0.1:0") as server:
        yield server, engine


async def post(
    server: Server, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{server.http_port}{path}"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=headers) as response,
    ):
        return response.status, await response.json(content_type=None)


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        ("http", "400"),
        ("http_aio", "400"),
        ("grpc", "INVALID_ARGUMENT"),
        ("grpc_aio", "INVALID_ARGUMENT"),
    ],
)
class TestBadInput:
    async def test_aiodla_refuses_the_values_with_its_message(
        self, server: Server, kind: str, code: str
    ) -> None:
        x = np.full((1, 4, 4, 4), np.nan, np.float32)  # NaN cannot be quantized to INT8
        exc = await failure(Client(kind, server).infer("int8", {"q": x}))
        assert status_of(kind, exc) == code
        assert "NaN" in exc.message() and "'q'" in exc.message()

    async def test_wrong_shape(self, server: Server, kind: str, code: str) -> None:
        x = np.zeros((1, 3, 4, 8), np.float16)
        exc = await failure(Client(kind, server).infer("affine", {"x": x}))
        assert status_of(kind, exc) == code
        assert "shape [1, 3, 4, 8], expected [1, 3, 8, 8]" in exc.message()

    async def test_wrong_datatype(self, server: Server, kind: str, code: str) -> None:
        x = np.zeros((1, 3, 8, 8), np.float32)
        exc = await failure(Client(kind, server).infer("affine", {"x": x}))
        assert status_of(kind, exc) == code
        assert "datatype 'FP32', expected FP16" in exc.message()

    async def test_missing_and_unknown_tensors(self, server: Server, kind: str, code: str) -> None:
        a = np.zeros((1, 4, 6, 6), np.float16)
        exc = await failure(Client(kind, server).infer("pair", {"a": a}))
        assert status_of(kind, exc) == code and "missing ['b']" in exc.message()
        exc = await failure(Client(kind, server).infer("affine", {"z": a}))
        assert status_of(kind, exc) == code and "'z'" in exc.message()
        x = sample(server.models["affine"].engine.inputs[0])
        exc = await failure(Client(kind, server).infer("affine", {"x": x}, outputs=["nope"]))
        assert status_of(kind, exc) == code and "'nope'" in exc.message()


class TestMalformedHttp:
    async def test_not_json(self, server: Server) -> None:
        status, body = await post(server, "/v2/models/affine/infer", b"{not json")
        assert status == 400 and "JSON" in body["error"]

    async def test_binary_sizes_that_do_not_add_up(self, server: Server) -> None:
        header = b'{"inputs":[{"name":"x","datatype":"FP16","shape":[1,3,8,8],"parameters":{"binary_data_size":384}}]}'
        status, body = await post(
            server,
            "/v2/models/affine/infer",
            header + bytes(10),
            {"Inference-Header-Content-Length": str(len(header))},
        )
        assert status == 400 and "binary" in body["error"]
        status, body = await post(
            server,
            "/v2/models/affine/infer",
            header + bytes(390),
            {"Inference-Header-Content-Length": str(len(header))},
        )
        assert status == 400 and "390 bytes of binary data but its inputs take 384" in body["error"]
        status, body = await post(
            server, "/v2/models/affine/infer", header, {"Inference-Header-Content-Length": "99999"}
        )
        assert status == 400

    async def test_ragged_and_out_of_range_json_data(self, server: Server) -> None:
        ragged = b'{"inputs":[{"name":"q","datatype":"INT8","shape":[1,4,4,4],"data":[[1,2],[3]]}]}'
        status, body = await post(server, "/v2/models/int8/infer", ragged)
        assert status == 400 and "'q'" in body["error"]
        big = (
            b'{"inputs":[{"name":"q","datatype":"INT8","shape":[1,4,4,4],"data":[300'
            + b",0" * 63
            + b"]}]}"
        )
        status, body = await post(server, "/v2/models/int8/infer", big)
        assert status == 400 and "INT8" in body["error"]
        few = b'{"inputs":[{"name":"q","datatype":"INT8","shape":[1,4,4,4],"data":[1,2,3]}]}'
        status, body = await post(server, "/v2/models/int8/infer", few)
        assert status == 400 and "3 values" in body["error"]

    async def test_bad_timeout_parameter(self, server: Server) -> None:
        body = b'{"parameters":{"timeout":-1},"inputs":[]}'
        status, answer = await post(server, "/v2/models/affine/infer", body)
        assert status == 400 and "timeout" in answer["error"]


@pytest.mark.parametrize(
    ("kind", "code"),
    [("http", "404"), ("http_aio", "404"), ("grpc", "NOT_FOUND"), ("grpc_aio", "NOT_FOUND")],
)
async def test_unknown_model(server: Server, kind: str, code: str) -> None:
    x = np.zeros((1, 3, 8, 8), np.float16)
    client = Client(kind, server)
    exc = await failure(client.infer("nope", {"x": x}))
    assert status_of(kind, exc) == code and "unknown model: 'nope'" in exc.message()
    exc = await failure(client.metadata("nope"))
    assert status_of(kind, exc) == code
    exc = await failure(client.infer("affine", {"x": x}, model_version="2"))
    assert status_of(kind, exc) == code and "version 2" in exc.message()


@pytest.mark.parametrize(
    ("kind", "code"),
    [("http", "503"), ("http_aio", "503"), ("grpc", "UNAVAILABLE"), ("grpc_aio", "UNAVAILABLE")],
)
async def test_queue_full(
    small: tuple[Server, Engine], aiodla_controls: DLAControls, kind: str, code: str
) -> None:
    server, engine = small
    x = sample(engine.inputs[0])
    with aiodla_controls.hold() as gate:
        held = [asyncio.ensure_future(engine.infer(x)) for _ in range(3)]  # 2 slots + 1 queued
        await gate.reached(2)
        exc = await failure(Client(kind, server).infer("affine", {"x": x}))
    assert status_of(kind, exc) == code and "queue is full" in exc.message()
    await asyncio.gather(*held)
    assert engine.statistics().rejected == 1
    assert server.statistics().failed == {"UNAVAILABLE": 1}


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        ("http", "504"),
        ("http_aio", "504"),
        ("grpc", "DEADLINE_EXCEEDED"),
        ("grpc_aio", "DEADLINE_EXCEEDED"),
    ],
)
async def test_deadline_parameter(
    small: tuple[Server, Engine], aiodla_controls: DLAControls, kind: str, code: str
) -> None:
    """Triton's request ``timeout`` parameter (microseconds) bounds the request."""
    server, engine = small
    x = sample(engine.inputs[0])
    with aiodla_controls.hold() as gate:
        held = [asyncio.ensure_future(engine.infer(x)) for _ in range(2)]  # both slots busy
        await gate.reached(2)
        exc = await failure(Client(kind, server).infer("affine", {"x": x}, timeout=50_000))
    assert status_of(kind, exc) == code
    await asyncio.gather(*held)
    assert engine.statistics().timed_out == 1
    assert server.statistics().failed == {"DEADLINE_EXCEEDED": 1}


@pytest.mark.parametrize("kind", GRPC_KINDS)
async def test_grpc_deadline(
    small: tuple[Server, Engine], aiodla_controls: DLAControls, kind: str
) -> None:
    """The call's own gRPC deadline bounds the request on the server too."""
    server, engine = small
    x = sample(engine.inputs[0])
    with aiodla_controls.hold() as gate:
        held = [asyncio.ensure_future(engine.infer(x)) for _ in range(2)]
        await gate.reached(2)
        exc = await failure(Client(kind, server).infer("affine", {"x": x}, client_timeout=0.1))
        assert status_of(kind, exc) == "DEADLINE_EXCEEDED"
        # The queued request ends on the server as well (timed out or cancelled), never
        # reaching the DLA, which is still held.
        await until(lambda: engine.statistics().queued == 0)
        stats = engine.statistics()
        assert stats.queued == 0 and stats.timed_out + stats.cancelled == 1
    await asyncio.gather(*held)


@pytest.mark.parametrize(
    ("kind", "code"),
    [("http", "503"), ("http_aio", "503"), ("grpc", "UNAVAILABLE"), ("grpc_aio", "UNAVAILABLE")],
)
async def test_dead_engine(
    aiodla_engine: EngineFactory, aiodla_controls: DLAControls, kind: str, code: str
) -> None:
    engine = await aiodla_engine(int8_model())
    async with Server({"int8": engine}, http="127.0.0.1:0", grpc="127.0.0.1:0") as server:
        client = Client(kind, server)
        aiodla_controls.poison()
        x = np.zeros((1, 4, 4, 4), np.int8)
        with pytest.raises(Exception):  # noqa: B017, PT011  (the request that meets the poison)
            await engine.infer(x)
        assert engine.dead
        exc = await failure(client.infer("int8", {"q": x}))
        assert status_of(kind, exc) == code and "dead" in exc.message()
        assert not await client.call("is_server_ready")
        assert not await client.call("is_model_ready", "int8")
        assert await client.call("is_server_live")


async def test_unimplemented_grpc_calls_say_so(server: Server) -> None:
    exc = await failure(Client("grpc_aio", server).call("get_model_config", "affine"))
    assert status_of("grpc_aio", exc) == "UNIMPLEMENTED"


@pytest.mark.parametrize("off", ["off", "OFF"])
async def test_a_front_turned_off_by_name(engines: dict[str, Any], off: str) -> None:
    """``Server(grpc="off")`` leaves gRPC out, as the command line's ``--grpc off`` does."""
    async with Server(engines, http="127.0.0.1:0", grpc=off) as server:
        assert server.grpc_port is None and server.http_port
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 200 ")
        writer.close()
    with pytest.raises(ConfigurationError, match="give an HTTP or a gRPC address"):
        Server(engines, http=off, grpc="off")
