"""SIGTERM with work in flight: ``aiodla serve`` stops accepting, answers every request
it accepted (counted on arrival: its headers or call came in, its body may still be
arriving), and exits 0; past the drain timeout the requests still running, and the
uploads still arriving, are answered UNAVAILABLE, never dropped.

The states are reached with aiodla.testing's controls (the DLA held at a gate) and the
server's own counts, never by waiting a while: ``serve()`` runs on the test's loop and
the test signals its own process, which ``serve()`` handles as ``aiodla serve`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http.aio as thttp_aio
from clients import until
from tritonclient.utils import InferenceServerException

from aiodla.serve import Server, serve
from aiodla.testing import DLAControls

from support import affine_model, expected_affine

pytestmark = pytest.mark.asyncio

REPO = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def serving(
    model: Path, controls: DLAControls, drain: float
) -> AsyncIterator[tuple[Server, asyncio.Future[Any]]]:
    """``serve()`` on this loop, on the controlled DLA: the server once it listens, and
    the future of serve's statistics."""
    started: asyncio.Future[Server] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(
            [str(model)],
            http="127.0.0.1:0",
            grpc="127.0.0.1:0",
            runtime=controls.runtime,
            drain_timeout=drain,
            started=started.set_result,
            streams_per_core=1,
        )
    )
    try:
        server = await asyncio.wait_for(asyncio.shield(started), 30)
        yield server, task
    finally:
        if not task.done():
            if started.done():  # serve() handles the signal from then on
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                task.cancel()
        controls.release_all()
        with contextlib.suppress(Exception):
            await task


async def send(server: Server, count: int) -> tuple[list[asyncio.Future[Any]], list[Any]]:
    """``count`` requests, alternately HTTP and gRPC, sent at once: their futures and
    their frames; every client is closed in the caller's ``finally`` (the list)."""
    http = thttp_aio.InferenceServerClient(f"127.0.0.1:{server.http_port}", conn_limit=count)
    grpc = tgrpc_aio.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    frames = [np.full((1, 3, 8, 8), i, np.float16) for i in range(count)]

    async def one(index: int) -> Any:
        module: Any = thttp_aio if index % 2 else tgrpc_aio
        client: Any = http if index % 2 else grpc
        tensor = module.InferInput("x", [1, 3, 8, 8], "FP16")
        tensor.set_data_from_numpy(frames[index])
        try:
            return (await client.infer("affine", [tensor])).as_numpy("y")
        except InferenceServerException as exc:
            return exc

    return [asyncio.ensure_future(one(i)) for i in range(count)], [http, grpc, frames]


async def close(clients: list[Any]) -> None:
    for client in clients[:2]:
        await client.close()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "affine.bin"
    path.write_bytes(affine_model())
    return path


async def test_every_accepted_request_is_answered(
    model: Path, aiodla_controls: DLAControls, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiodla.serve")
    gate = aiodla_controls.hold()
    async with serving(model, aiodla_controls, drain=30) as (server, stats):
        futures, clients = await send(server, 12)
        try:
            await until(lambda: server.statistics().in_flight == 12)  # all accepted
            await gate.reached(2)  # one on each core's slot, ten queued behind them
            os.kill(os.getpid(), signal.SIGTERM)
            await until(lambda: not server.accepting)
            # Closed for new connections since the signal; the accepted ones run on.
            with pytest.raises(aiohttp.ClientConnectionError):
                async with aiohttp.ClientSession() as session:
                    await session.get(f"http://127.0.0.1:{server.http_port}/v2/health/live")
            gate.release()
            results = await asyncio.gather(*futures)
        finally:
            await close(clients)
        statistics = await stats
    for result, frame in zip(results, clients[2]):
        assert isinstance(result, np.ndarray), result
        assert result.tobytes() == expected_affine(frame).tobytes()
    assert statistics.succeeded == 12 and statistics.received == 12
    assert "draining 12 request(s)" in caplog.text


async def test_past_the_drain_timeout_requests_are_answered_unavailable(
    model: Path, aiodla_controls: DLAControls, caplog: pytest.LogCaptureFixture
) -> None:
    gate = aiodla_controls.hold()
    async with serving(model, aiodla_controls, drain=0.1) as (server, stats):
        futures, clients = await send(server, 6)
        try:
            await until(lambda: server.statistics().in_flight == 6)
            await gate.reached(2)
            os.kill(os.getpid(), signal.SIGTERM)  # the DLA stays held past the drain
            results = await asyncio.gather(*futures)
        finally:
            await close(clients)
            gate.release()
        statistics = await stats
    for exc in results:
        assert isinstance(exc, InferenceServerException), exc
        assert str(exc.status()) in ("503", "StatusCode.UNAVAILABLE"), exc
        assert "drain timeout" in exc.message()
    assert statistics.failed == {"UNAVAILABLE": 6}
    assert "answered UNAVAILABLE" in caplog.text


async def test_an_upload_still_arriving_at_the_drain_timeout_is_answered_503(
    model: Path, aiodla_controls: DLAControls
) -> None:
    async with serving(model, aiodla_controls, drain=0.1) as (server, stats):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        try:
            writer.write(
                b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
            )
            await writer.drain()
            await until(lambda: server.statistics().in_flight == 1)
            os.kill(os.getpid(), signal.SIGTERM)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = json.loads(await reader.readexactly(length))
        finally:
            writer.close()
        statistics = await stats
    assert head.startswith(b"HTTP/1.1 503 "), head
    assert "shut down" in body["error"] and "drain timeout" in body["error"]
    assert statistics.failed == {"UNAVAILABLE": 1}


async def test_the_command_stops_on_sigterm_and_exits_0(model: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiodla", "serve", str(model), "--runtime", "emulated",
        "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0",
        stderr=asyncio.subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert process.stderr is not None
        line = (await asyncio.wait_for(process.stderr.readline(), 60)).decode()
        assert re.search(r"HTTP port (\d+); gRPC port (\d+)", line), line
        process.send_signal(signal.SIGTERM)
        rest = (await asyncio.wait_for(process.stderr.read(), 60)).decode()
        assert await process.wait() == 0, rest
        assert "aiodla serve: stopped" in rest
        # The server's log lines carry the command's prefix once (not the logger's too).
        assert "aiodla serve: stopping\n" in rest and "aiodla.serve" not in rest, rest
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
