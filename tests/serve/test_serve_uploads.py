"""Slow and stalled uploads: a request body holds the byte budget only for the bytes
that arrived, so sockets that declare a large body and go idle hold up no one; a body
that does not arrive within ``body_timeout`` (seconds a MiB) is answered 408."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from clients import Client, until

from aiodla import Engine
from aiodla.serve import Server

from support import expected_affine

MIB = 1024 * 1024
HEAD = b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"


@contextlib.asynccontextmanager
async def stalled(server: Server, count: int, size: int, sent: int) -> AsyncIterator[list[Any]]:
    """``count`` sockets that declare a ``size`` byte body, send ``sent`` bytes of it and
    go idle; closed at the end."""
    writers = []
    try:
        for _ in range(count):
            _, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
            writers.append(writer)
            writer.write(HEAD % size + b"{" + b" " * (sent - 1))
            await writer.drain()
        yield writers
    finally:
        for writer in writers:
            writer.close()
        for writer in writers:
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, Any]]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, json.loads(await reader.readexactly(length))


@pytest_asyncio.fixture
async def tight(
    engines: dict[str, Engine], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Server]:
    """A byte budget of 4 MiB (the tiny models take 1 MiB a request) and a body
    timeout no test reaches unless it means to."""
    from aiodla.serve import _http

    monkeypatch.setattr(_http, "MIN_BUDGET_BYTES", 4 * MIB)
    async with Server(
        engines, http="127.0.0.1:0", grpc="127.0.0.1:0", drain_timeout=5, body_timeout=60
    ) as server:
        yield server


@pytest.mark.asyncio
@pytest.mark.parametrize("sent", [1, 64 * 1024])
async def test_stalled_uploads_hold_up_no_other_request(tight: Server, sent: int) -> None:
    """Twice the budget's worth of bodies declared and stalled: requests over both
    protocols are still answered, and the stalled ones hold only what they sent."""
    async with stalled(tight, count=8, size=MIB, sent=sent):
        # Every stalled request is in the server (it counts them on arrival).
        await until(lambda: tight.statistics().in_flight == 8)
        x = np.full((1, 3, 8, 8), 1.5, np.float16)
        for kind in ("http", "http_aio", "grpc"):
            outputs, _ = await asyncio.wait_for(Client(kind, tight).infer("affine", {"x": x}), 20)
            assert outputs["y"].tobytes() == expected_affine(x).tobytes()
        assert tight.statistics().in_flight == 8
    # Closing a stalled upload's socket is the caller going away.
    await until(lambda: not tight.statistics().in_flight)
    assert tight.statistics().failed == {"CANCELLED": 8}


@pytest.mark.asyncio
async def test_a_body_that_stalls_is_answered_408(engines: dict[str, Engine]) -> None:
    async with Server(engines, http="127.0.0.1:0", grpc=None, body_timeout=0.05) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        try:
            writer.write(HEAD % 1000 + b'{"inputs": [')
            await writer.drain()
            head, body = await asyncio.wait_for(answer(reader), 20)
            assert head.startswith(b"HTTP/1.1 408 "), head
            assert "1000 byte" in body["error"] and "0.05 s" in body["error"], body
            # The rest of the body is not read as a next request: the connection closes.
            assert b"connection: close" in head.lower(), head
        finally:
            writer.close()
        assert server.statistics().failed == {"DEADLINE_EXCEEDED": 1}


@pytest.mark.asyncio
async def test_body_timeout_must_be_positive(engines: dict[str, Engine]) -> None:
    from aiodla import ConfigurationError

    with pytest.raises(ConfigurationError, match="body_timeout"):
        Server(engines, http="127.0.0.1:0", grpc=None, body_timeout=0)


class TestBudgetAccounts:
    """The budget grants a body's bytes as they arrive, never into a state where the
    bodies being received could not all finish."""

    async def _receive(self, budget: Any, size: int, chunk: int, order: list[int]) -> None:
        async with budget.account(size) as account:
            for _ in range(0, size, chunk):
                await account.take(chunk)
                await asyncio.sleep(0)
            order.append(size)

    @pytest.mark.asyncio
    async def test_interleaved_uploads_larger_than_the_budget_all_finish(self) -> None:
        from aiodla.serve._budget import ByteBudget

        budget = ByteBudget(100)
        order: list[int] = []
        # Ten bodies of 40 arriving 10 at a time, interleaved: granting each chunk as
        # it comes would fill the budget with halves that all wait for each other.
        await asyncio.wait_for(
            asyncio.gather(*(self._receive(budget, 40, 10, order) for _ in range(10))), 20
        )
        assert order == [40] * 10 and budget.held == 0

    @pytest.mark.asyncio
    async def test_first_come_first_served(self) -> None:
        from aiodla.serve._budget import ByteBudget

        budget = ByteBudget(100)
        order: list[str] = []

        async def body(name: str, size: int) -> None:
            async with budget.account(size) as account:
                await account.take(size)
                order.append(name)

        async with budget.account(60) as first:
            await first.take(60)
            queued = [asyncio.ensure_future(body(n, s)) for n, s in (("big", 70), ("small", 10))]
            for _ in range(5):
                await asyncio.sleep(0)
            # "small" would fit, but waits behind "big": no request starves.
            assert order == [] and budget.held == 60
        await asyncio.wait_for(asyncio.gather(*queued), 20)
        assert order == ["big", "small"] and budget.held == 0

    @pytest.mark.asyncio
    async def test_an_idle_account_holds_nothing(self) -> None:
        from aiodla.serve._budget import ByteBudget

        budget = ByteBudget(100)
        async with budget.account(90), budget.account(90), budget.account(90):
            order: list[int] = []
            await asyncio.wait_for(self._receive(budget, 9, 3, order), 20)
            assert order == [9] and budget.held == 0

    @pytest.mark.asyncio
    async def test_a_cancelled_wait_takes_nothing(self) -> None:
        from aiodla.serve._budget import ByteBudget

        budget = ByteBudget(100)
        async with budget.account(100) as first:
            await first.take(100)
            async with budget.account(50) as second:
                waiter = asyncio.ensure_future(second.take(50))
                await asyncio.sleep(0)
                waiter.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiter
            assert budget.held == 100
        assert budget.held == 0
