"""SIGTERM to an ``aiodla serve`` process with work in flight: it stops accepting,
answers every request it accepted, and exits 0; past ``--drain-timeout`` the requests
still running are answered UNAVAILABLE, never dropped."""

from __future__ import annotations

import asyncio
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
import pytest_asyncio
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http.aio as thttp_aio
from tritonclient.utils import InferenceServerException

from support import affine_model, expected_affine

pytestmark = pytest.mark.asyncio

REPO = Path(__file__).resolve().parents[2]


class Process:
    def __init__(self, process: asyncio.subprocess.Process, http: int, grpc: int) -> None:
        self.process = process
        self.http = http
        self.grpc = grpc
        self.stderr = ""


@pytest_asyncio.fixture
async def start(tmp_path: Path) -> AsyncIterator[Any]:
    started: list[Process] = []

    async def start(latency: float, drain: float) -> Process:
        model = tmp_path / "affine.bin"
        model.write_bytes(affine_model(latency))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiodla", "serve", str(model), "--runtime", "emulated",
            "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--streams", "1",
            "--drain-timeout", str(drain),
            stderr=asyncio.subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert process.stderr is not None
        line = (await asyncio.wait_for(process.stderr.readline(), 30)).decode()
        found = re.search(r"HTTP port (\d+); gRPC port (\d+)", line)
        assert found, line
        served = Process(process, int(found[1]), int(found[2]))
        started.append(served)
        return served

    yield start
    for served in started:
        if served.process.returncode is None:
            served.process.kill()
            await served.process.wait()


async def in_flight(port: int) -> float:
    """Requests the engine holds (queued or running), read from /metrics."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as r,
    ):
        text = await r.text()
    return sum(
        float(m[1])
        for m in re.finditer(r'aiodla_(?:pending|inflight)_requests\{engine="affine"\} (\S+)', text)
    )


async def send(served: Process, count: int) -> tuple[list[Any], list[np.ndarray[Any, Any]]]:
    frames = [np.full((1, 3, 8, 8), i, np.float16) for i in range(count)]
    http = thttp_aio.InferenceServerClient(f"127.0.0.1:{served.http}", conn_limit=count)
    grpc = tgrpc_aio.InferenceServerClient(f"127.0.0.1:{served.grpc}")

    async def one(index: int) -> Any:
        module: Any = thttp_aio if index % 2 else tgrpc_aio
        client: Any = http if index % 2 else grpc
        tensor = module.InferInput("x", [1, 3, 8, 8], "FP16")
        tensor.set_data_from_numpy(frames[index])
        try:
            return (await client.infer("affine", [tensor])).as_numpy("y")
        except InferenceServerException as exc:
            return exc

    tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
    # Every request accepted by the server before the signal, seen from its metrics.
    for _ in range(1000):
        if await in_flight(served.http) == count:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the requests did not all reach the server")
    served.process.send_signal(signal.SIGTERM)
    try:
        results = await asyncio.gather(*tasks)
    finally:
        await http.close()
        await grpc.close()
    return results, frames


async def finish(served: Process) -> str:
    assert served.process.stderr is not None
    rest = await asyncio.wait_for(served.process.stderr.read(), 30)
    assert await served.process.wait() == 0, rest
    return rest.decode()


async def test_every_accepted_request_is_answered(start: Any) -> None:
    served = await start(latency=0.05, drain=10)  # 12 requests on 2 slots: ~0.3 s
    results, frames = await send(served, 12)
    for result, frame in zip(results, frames):
        assert isinstance(result, np.ndarray), result
        assert result.tobytes() == expected_affine(frame).tobytes()
    stderr = await finish(served)
    assert "draining 12 request(s)" in stderr and "aiodla serve: stopped" in stderr
    # Closed for new connections since the signal.
    with pytest.raises(aiohttp.ClientConnectionError):
        await in_flight(served.http)


async def test_past_the_drain_timeout_requests_are_answered_unavailable(start: Any) -> None:
    served = await start(latency=0.4, drain=0.2)  # 6 requests on 2 slots: ~1.2 s
    results, _ = await send(served, 6)
    failed = [r for r in results if not isinstance(r, np.ndarray)]
    assert failed, "every request finished within the drain timeout"
    for exc in failed:
        assert str(exc.status()) in ("503", "StatusCode.UNAVAILABLE"), exc
        assert "drain timeout" in exc.message()
    stderr = await finish(served)
    assert "answered UNAVAILABLE" in stderr
