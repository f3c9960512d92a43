"""The HTTP front as a listener: each server on the port its address asks for (port 0:
one the system picks, so servers started side by side never collide), a port taken
refused at start with the server still stoppable, a connection kept alive past a
refusal of a body read whole, no access log line per request, and a server that stops
even while an answer waits on a client that reads nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import aiohttp
import numpy as np
import pytest
from clients import until

from aiodla import Engine, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.serve import Server
from aiodla.testing import EngineFactory

from support import X, expected_affine

pytestmark = pytest.mark.asyncio


async def test_servers_on_port_zero_each_listen_on_a_port_of_their_own(
    engines: dict[str, Engine],
) -> None:
    async with (
        Server(engines, http="127.0.0.1:0", grpc=None) as first,
        Server(engines, http="127.0.0.1:0", grpc=None) as second,
        aiohttp.ClientSession() as session,
    ):
        ports = {first.http_port, second.http_port}
        assert len(ports) == 2 and 0 not in ports
        for port in ports:
            async with session.get(f"http://127.0.0.1:{port}/v2/health/live") as response:
                assert response.status == 200


async def test_a_port_taken_fails_the_start_and_the_server_still_stops(
    engines: dict[str, Engine],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = Server(engines, http=f"127.0.0.1:{taken.getsockname()[1]}", grpc=None)
        with pytest.raises(OSError, match="address already in use"):
            await server.start()
        await server.stop()  # nothing listens: nothing to stop, and no error


def counting_connections() -> tuple[aiohttp.TraceConfig, list[object]]:
    """A client trace that lists each connection the session opens."""
    connections: list[object] = []

    async def connected(*args: object) -> None:
        connections.append(args)

    tracing = aiohttp.TraceConfig()
    tracing.on_connection_create_end.append(connected)
    return tracing, connections


async def test_a_refusal_after_the_whole_body_keeps_the_connection(server: Server) -> None:
    # A 400 for a body read whole leaves nothing unread on the connection: the next
    # request goes on it. (A refusal before the body is read closes it: see
    # test_serve_limits' 413 from the Content-Length.)
    x = (np.arange(np.prod(X.shape)).reshape(X.shape) / 8).astype(np.float16)
    tensor = {"name": "x", "datatype": "FP16", "shape": list(X.shape)}
    url = f"http://127.0.0.1:{server.http_port}/v2/models/affine/infer"
    tracing, connections = counting_connections()
    async with aiohttp.ClientSession(trace_configs=[tracing]) as session:
        async with session.post(url, json={"inputs": [{**tensor, "data": [1.0]}]}) as refused:
            assert refused.status == 400
            assert "Connection" not in refused.headers
        body = {"inputs": [{**tensor, "data": x.ravel().tolist()}]}
        async with session.post(url, json=body) as response:
            assert response.status == 200
            (output,) = (await response.json())["outputs"]
            assert output["data"] == expected_affine(x).ravel().tolist()
    assert len(connections) == 1


async def test_requests_leave_no_access_log_line(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp.access")
    url = f"http://127.0.0.1:{server.http_port}/v2/health/live"
    tracing, connections = counting_connections()
    async with aiohttp.ClientSession(trace_configs=[tracing]) as session:
        # Two on one connection: the server is done with the first, its log line
        # included, before it reads the second.
        for _ in range(2):
            async with session.get(url) as response:
                assert response.status == 200
    assert len(connections) == 1
    assert [r for r in caplog.records if r.name == "aiohttp.access"] == []


async def test_the_server_stops_while_an_answer_waits_on_a_client_that_reads_nothing(
    aiodla_engine: EngineFactory,
) -> None:
    # A 32 MiB answer fills the socket buffers of a client that never reads it: its
    # handler waits to write the rest. Closing gives such a handler the runner's one
    # second, not aiohttp's default minute (past the test's timeout) nor for ever.
    x_spec = TensorSpec("x", (1, 32, 512, 512), "float16", "nchw")
    y_spec = TensorSpec("y", (1, 32, 512, 512), "float32", "nchw")
    engine = await aiodla_engine(make_loadable([x_spec], [y_spec], "affine", 0.001))
    x = np.zeros(x_spec.shape, np.float16).tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP16",
                    "shape": list(x_spec.shape),
                    "parameters": {"binary_data_size": len(x)},
                }
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    server = Server({"big": engine}, http="127.0.0.1:0", grpc=None, drain_timeout=0)
    await server.start()
    _, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        writer.write(
            b"POST /v2/models/big/infer HTTP/1.1\r\nHost: x\r\n"
            b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
            % (len(header), len(header) + len(x))
            + header
            + x
        )
        await writer.drain()
        await until(lambda: server.statistics().succeeded == 1)  # answered: being written
        await server.stop()
    finally:
        writer.close()
