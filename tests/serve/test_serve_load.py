"""1,000 concurrent requests with deadlines through both fronts at once: some expire,
every one is answered, and the server's and the engine's counts add up."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http.aio as thttp_aio
from clients import until
from tritonclient.utils import InferenceServerException

from aiodla.serve import Server
from aiodla.testing import EngineFactory

from support import affine_model, counts_add_up, expected_affine

pytestmark = pytest.mark.asyncio

REQUESTS = 1000
DEADLINE = 0.15  # seconds, on every other request: the later ones in the queue expire


async def test_a_thousand_concurrent_requests_with_deadlines(aiodla_engine: EngineFactory) -> None:
    engine = await aiodla_engine(affine_model(0.001), cores=[0, 1], streams_per_core=2)
    rng = np.random.default_rng(1)
    frames = [rng.standard_normal((1, 3, 8, 8)).astype(np.float16) for _ in range(REQUESTS)]
    async with Server({"affine": engine}, http="127.0.0.1:0", grpc="127.0.0.1:0") as server:
        http = thttp_aio.InferenceServerClient(f"127.0.0.1:{server.http_port}", conn_limit=REQUESTS)
        grpc = tgrpc_aio.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

        async def one(index: int) -> str:
            x = frames[index]
            bounded = index % 2 == 0
            try:
                if index % 4 < 2:  # HTTP, Triton's timeout parameter (microseconds)
                    tensor = thttp_aio.InferInput("x", [1, 3, 8, 8], "FP16")
                    tensor.set_data_from_numpy(x)
                    timeout = int(DEADLINE * 1e6) if bounded else None
                    result: Any = await http.infer("affine", [tensor], timeout=timeout)
                else:  # gRPC, the call's own deadline
                    tensor = tgrpc_aio.InferInput("x", [1, 3, 8, 8], "FP16")
                    tensor.set_data_from_numpy(x)
                    client_timeout = DEADLINE if bounded else None
                    result = await grpc.infer("affine", [tensor], client_timeout=client_timeout)
            except InferenceServerException as exc:
                assert bounded, f"request {index} without a deadline failed: {exc}"
                assert str(exc.status()) in ("504", "StatusCode.DEADLINE_EXCEEDED"), exc
                return "expired"
            assert result.as_numpy("y").tobytes() == expected_affine(x).tobytes(), index
            return "ok in time" if bounded else "ok"

        try:
            outcomes = await asyncio.gather(*(one(i) for i in range(REQUESTS)))
        finally:
            await http.close()
            await grpc.close()
        in_time, expired = outcomes.count("ok in time"), outcomes.count("expired")
        ok = outcomes.count("ok") + in_time
        assert ok + expired == REQUESTS
        assert expired > 0 and in_time > 0, (expired, in_time)  # some, not all, expired

        # Every request that reached the server was answered and counted once. A gRPC
        # call whose deadline passed in the client's own queue never reached it; one
        # can also end on the server just after its client gave up waiting.
        served = server.statistics()
        assert served.in_flight == 0
        assert served.succeeded + sum(served.failed.values()) == served.received
        assert REQUESTS // 2 <= served.received <= REQUESTS  # every HTTP request arrived
        assert set(served.failed) <= {"DEADLINE_EXCEEDED", "CANCELLED"}
        assert ok <= served.succeeded

        # Cancelled tasks may still be finishing on the DLA.
        await until(lambda: engine.statistics().in_flight == engine.statistics().queued == 0)
        stats = engine.statistics()
        assert counts_add_up(stats) and stats.queued == stats.in_flight == 0
        # A gRPC call can also reach the server with its deadline already passed (the
        # loop busy with 1,000 requests): answered DEADLINE_EXCEEDED, never submitted.
        expired_on_arrival = served.received - stats.submitted
        assert 0 <= expired_on_arrival <= served.failed.get("DEADLINE_EXCEEDED", 0)
        assert stats.rejected == stats.failed == 0
        assert stats.completed + stats.timed_out + stats.cancelled == stats.submitted
        assert stats.completed >= served.succeeded
        assert stats.timed_out + stats.cancelled + expired_on_arrival >= served.failed.get(
            "DEADLINE_EXCEEDED", 0
        )
