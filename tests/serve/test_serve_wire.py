"""Malformed HTTP on the wire: every error the server's handlers see is answered as
``{"error": ...}`` with its status (a body that cannot be decoded is 400, not 500);
the HTTP parser's own refusals, before any handler runs, are 400 ``{"error": ...}`` too,
naming what the parser refused, with one log line each (at most a burst of them)."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from typing import Any

import pytest
from clients import until

from aiodla.serve import Server

pytestmark = pytest.mark.asyncio

INFER = b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\n"


async def exchange(server: Server, *parts: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``parts`` (waiting, between them, until the server holds the request),
    read one answer: its status, headers and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        for index, part in enumerate(parts):
            if index:
                await until(lambda: server.statistics().in_flight > 0)
            writer.write(part)
            await writer.drain()
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)).decode("latin-1")
        lines = head.split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 20)
        return int(lines[0].split()[1]), headers, body
    finally:
        writer.close()


def error_of(headers: dict[str, str], body: bytes) -> str:
    assert headers["content-type"].startswith("application/json"), (headers, body)
    message = json.loads(body)["error"]
    assert isinstance(message, str)
    return message


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_does_not_decode_is_400_json(server: Server, encoding: str) -> None:
    body = b'{"inputs": []}' * 4
    status, headers, answer = await exchange(
        server,
        INFER
        + b"Content-Encoding: %s\r\nContent-Length: %d\r\n\r\n" % (encoding.encode(), len(body)),
        body,
    )
    assert status == 400, answer
    assert "request body" in error_of(headers, answer)
    assert server.statistics().failed == {"INVALID_ARGUMENT": 1}


async def test_gzip_that_decodes_is_taken(server: Server) -> None:
    body = gzip.compress(b'{"inputs": []}')
    status, headers, answer = await exchange(
        server, INFER + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    # Decoded: the request's JSON is read (and refused for its empty inputs).
    assert status == 400 and "expected 1 inputs but got 0" in error_of(headers, answer)


async def test_an_unexpected_error_of_any_route_is_json(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("metadata is broken")

    monkeypatch.setattr(type(server), "server_metadata", broken)
    status, headers, answer = await exchange(server, b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 500
    assert "metadata is broken" in error_of(headers, answer)


# The HTTP parser's own refusals (aiohttp answered them in plain text).
PARSER_ERRORS = {
    "duplicate Content-Length": INFER + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "invalid Content-Length": INFER + b"Content-Length: abc\r\n\r\n{}",
    "Content-Length with chunked": INFER
    + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "bad chunk size at the start": INFER + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n",
    "URL over 8190 bytes": b"GET /v2/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "header over 8190 bytes": b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-A: " + b"y" * 9000 + b"\r\n\r\n",
    "non-ASCII path": "GET /v2/models/\u00e9 HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
    "too many headers": b"GET /v2 HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-%d: y\r\n" % i for i in range(200))
    + b"\r\n",
    "garbage request line": b"HELLO THERE\r\n\r\n",
    "unknown HTTP version": b"GET /v2 HTTP/9.9\r\nHost: x\r\n\r\n",
    "bad method characters": b"G(T /v2 HTTP/1.1\r\nHost: x\r\n\r\n",
    "header without a colon": b"GET /v2 HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n",
    "space before a header's colon": b"GET /v2 HTTP/1.1\r\nHost : x\r\n\r\n",
    "control byte in a header": b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n",
    "negative Content-Length": INFER + b"Content-Length: -1\r\n\r\n",
    "TLS to the plain port": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32,
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "unknown transfer coding": INFER + b"Transfer-Encoding: gzip, zz\r\n\r\n",
}


@pytest.mark.parametrize("case", PARSER_ERRORS)
async def test_the_parsers_own_refusals_are_json_400(server: Server, case: str) -> None:
    status, headers, body = await exchange(server, PARSER_ERRORS[case])
    assert status in (400, 501), body
    message = error_of(headers, body)
    assert message.startswith(("Bad Request", "Not Implemented")), message
    assert server.statistics().received == 0  # no handler saw it


async def test_the_parsers_refusals_log_a_burst_not_a_line_each(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    from aiodla.serve import _log

    caplog.set_level(logging.DEBUG)
    for _ in range(3 * _log.BURST):
        status, headers, body = await exchange(server, PARSER_ERRORS["garbage request line"])
        assert status == 400 and error_of(headers, body)
    lines = [r for r in caplog.records if r.name.startswith(("aiohttp", "aiodla", "asyncio"))]
    assert 1 <= len(lines) <= _log.BURST, [r.getMessage() for r in lines]
    assert all(r.exc_info is None for r in lines)  # one line each, no traceback


@pytest.mark.parametrize("message", [b"\xff\xff\xff", b"\x0a\x05ab"])
async def test_a_malformed_grpc_message_is_invalid_argument_and_counted(
    server: Server, message: bytes
) -> None:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call(message)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ModelInferRequest" in str(error.value.details())
    assert server.statistics().failed == {"INVALID_ARGUMENT": 1}
