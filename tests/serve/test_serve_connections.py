"""The HTTP front's connections, on real sockets with small timeouts: headers that
trickle in are answered 408 and closed (as slow bodies are), a connection over the
cap is answered 503, TLS handshakes that stall are bounded in number and in time (no
SSL object or buffer outlives them), and the TLS option files are read safely."""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import gc
import json
import os
import ssl
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from aiodla import ConfigurationError, Engine
from aiodla.serve import Server, _connections

from support import affine_model

pytestmark = pytest.mark.asyncio

HEALTH = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
# The first bytes of a TLS record (a handshake record's header): then nothing more.
STALLED_HELLO = b"\x16\x03\x01\x02\x00"


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[Engine]:
    async with Engine(affine_model(), runtime="emulated") as opened:
        yield opened


@pytest_asyncio.fixture
async def server(engine: Engine) -> AsyncIterator[Server]:
    async with Server(
        {"affine": engine}, http="127.0.0.1:0", grpc=None, header_timeout=0.3
    ) as opened:
        yield opened


async def read_answer(reader: asyncio.StreamReader, bound: float = 10) -> tuple[int, Any]:
    """One HTTP answer's status and JSON body; the server must send it within ``bound``."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), bound)).decode("latin-1")
    length = int(head.lower().split("content-length: ")[1].split("\r\n")[0])
    body = await asyncio.wait_for(reader.readexactly(length), bound)
    return int(head.split()[1]), json.loads(body)


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection within 5 s (whatever it said before)."""
    try:
        await asyncio.wait_for(reader.read(), 5)  # (read() returns at the end only)
    except ConnectionResetError:  # closed by an abort: a reset
        pass
    return reader.at_eof() or reader.exception() is not None


async def healthy(port: int, context: ssl.SSLContext | None = None) -> bool:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        writer.write(HEALTH)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        return head.startswith(b"HTTP/1.1 200 ")
    finally:
        writer.close()


# -- slow headers ---------------------------------------------------------------------------


async def test_headers_that_trickle_in_are_408_and_closed(server: Server) -> None:
    """A byte of the headers every 0.1 s, never the end: after header_timeout (0.3 s)
    each connection is answered 408 and closed, while a good client is served."""

    async def slow_client() -> tuple[int, Any, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        started = time.monotonic()
        try:

            async def trickle() -> None:
                for byte in HEALTH[:-4]:  # never the blank line that ends them
                    writer.write(bytes([byte]))
                    await asyncio.sleep(0.1)

            sender = asyncio.ensure_future(trickle())
            try:
                status, body = await read_answer(reader, bound=5)
            finally:
                sender.cancel()
            assert await closed(reader)
            return status, body, time.monotonic() - started
        finally:
            writer.close()

    slow = [asyncio.ensure_future(slow_client()) for _ in range(20)]
    assert await healthy(server.http_port)
    for status, body, took in await asyncio.gather(*slow):
        assert status == 408
        assert "headers did not arrive within 0.3 s" in body["error"]
        assert took < 5
    assert server.statistics().received == 0  # no request began
    assert len(server_listener(server).connections) == 0


async def test_a_connection_that_sends_nothing_is_closed(server: Server) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        status, body = await read_answer(reader, bound=5)
        assert status == 408 and "header_timeout" in body["error"]
    finally:
        writer.close()


async def test_headers_in_time_and_a_long_request_are_served(engine: Engine) -> None:
    """The header time covers the headers only: keep-alive requests, each sent in
    pieces within it, idle between them for longer, and a body that comes later than it
    (the body has its own timeout) are served."""
    async with Server(
        {"affine": engine}, http="127.0.0.1:0", grpc=None, header_timeout=1.0
    ) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        try:
            for _ in range(2):
                for piece in (HEALTH[:10], HEALTH[10:20], HEALTH[20:]):
                    writer.write(piece)
                    await asyncio.sleep(0.05)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200 "), head
                await asyncio.sleep(1.2)  # idle between requests: keep-alive, not headers
            tensor = {"name": "x", "datatype": "FP16", "shape": [1, 3, 8, 8], "data": [0.5] * 192}
            x = json.dumps({"inputs": [tensor]}).encode()
            writer.write(
                b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                % len(x)
            )
            await asyncio.sleep(1.2)  # the body comes later than header_timeout
            writer.write(x)
            status, body = await read_answer(reader)
            assert status == 200, body
        finally:
            writer.close()


async def test_grpc_has_the_same_cap_and_handshake_time(engine: Engine) -> None:
    async with Server(
        {"affine": engine}, http=None, grpc="127.0.0.1:0", max_connections=2, header_timeout=2.5
    ) as server:
        held = [await asyncio.open_connection("127.0.0.1", server.grpc_port) for _ in range(2)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.grpc_port)
        started = time.monotonic()
        assert await closed(reader) and time.monotonic() - started < 1.5  # over the cap: at once
        writer.close()
        for reader, writer in held:  # no HTTP/2 preface within header_timeout: closed
            assert await closed(reader)
            writer.close()


# -- the connection cap ------------------------------------------------------------------------


async def test_a_connection_over_the_cap_is_503_and_a_freed_place_serves(engine: Engine) -> None:
    async with Server(
        {"affine": engine}, http="127.0.0.1:0", grpc=None, max_connections=4, header_timeout=30
    ) as server:
        held = [await asyncio.open_connection("127.0.0.1", server.http_port) for _ in range(4)]
        await until_open(server, 4)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        status, body = await read_answer(reader)
        writer.close()
        assert status == 503 and "4 connections" in body["error"]
        held.pop()[1].close()
        await until_open(server, 3)
        assert await healthy(server.http_port)
        for _, w in held:
            w.close()


async def test_the_cap_keeps_to_half_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096))
    assert _connections.connection_cap(1024) == 128
    assert _connections.connection_cap(100) == 100


@pytest.mark.parametrize("options", [{"max_connections": 0}, {"header_timeout": 0}])
async def test_bad_limits_are_refused(engine: Engine, options: dict[str, Any]) -> None:
    name = next(iter(options))
    with pytest.raises(ConfigurationError, match=name):
        Server({"affine": engine}, http="127.0.0.1:0", grpc=None, **options)


def server_listener(server: Server) -> Any:
    front = server._http  # (the front's listener: its connections, as counted)
    assert front is not None and front.listener is not None
    return front.listener


async def until_open(server: Server, count: int) -> None:
    while len(server_listener(server).connections) != count:
        await asyncio.sleep(0.005)


# -- TLS handshakes ----------------------------------------------------------------------------


def live_ssl_protocols() -> int:
    gc.collect()
    return sum(isinstance(o, asyncio.sslproto.SSLProtocol) for o in gc.get_objects())


@pytest.fixture
def cert_files(tmp_path: Path) -> tuple[Path, Path]:
    from test_serve_tls import self_signed

    return self_signed(tmp_path, "server")


@pytest.mark.timeout(60)
async def test_stalled_handshakes_are_bounded_in_number_and_time(
    engine: Engine, cert_files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 clients that start a handshake and stall: at most MAX_HANDSHAKES (4 here) hold
    TLS state (asyncio's SSLProtocol and its 256 KiB buffer) at once, each is closed
    after header_timeout, and none outlives its connection."""
    monkeypatch.setattr(_connections, "MAX_HANDSHAKES", 4)
    before = live_ssl_protocols()
    cert, key = cert_files
    async with Server(
        {"affine": engine}, http="127.0.0.1:0", grpc=None, header_timeout=0.3,
        tls_cert=cert, tls_key=key,
    ) as server:  # fmt: skip
        stalled = [await asyncio.open_connection("127.0.0.1", server.http_port) for _ in range(40)]
        for _, writer in stalled:
            writer.write(STALLED_HELLO)
        await until_open(server, 40)
        peak = 0
        while server_listener(server).connections:
            peak = max(peak, live_ssl_protocols() - before)
            await asyncio.sleep(0.05)
        assert 1 <= peak <= 4
        for reader, writer in stalled:  # each closed by the server
            assert await closed(reader)
            writer.close()
        client = ssl.create_default_context(cafile=cert)
        assert await healthy(server.http_port, client)  # and it still serves
    assert live_ssl_protocols() == before


async def test_aborted_handshakes_leave_nothing(
    engine: Engine, cert_files: tuple[Path, Path]
) -> None:
    cert, key = cert_files
    before = live_ssl_protocols()
    async with Server(
        {"affine": engine}, http="127.0.0.1:0", grpc=None, tls_cert=cert, tls_key=key
    ) as server:
        for _ in range(5):
            connections = [
                await asyncio.open_connection("127.0.0.1", server.http_port) for _ in range(20)
            ]
            for _, writer in connections:
                writer.write(STALLED_HELLO)
                writer.transport.abort()
        await until_open(server, 0)
        assert live_ssl_protocols() == before


# -- the TLS option files ------------------------------------------------------------------------


def encrypted_key(tmp_path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "locked.key"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    return path


async def test_option_files_are_read_safely(
    engine: Engine, cert_files: tuple[Path, Path], tmp_path: Path
) -> None:
    cert, key = cert_files
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)
    big = tmp_path / "big.pem"
    big.write_bytes(b"x" * (2 * 1024 * 1024))
    cases = [
        ({"tls_cert": "/dev/zero", "tls_key": key}, "/dev/zero is not a regular file"),
        ({"tls_cert": fifo, "tls_key": key}, r"fifo\.pem is not a regular file"),
        ({"tls_cert": cert, "tls_key": tmp_path}, "not a regular file"),
        ({"tls_cert": big, "tls_key": key}, "larger than 1048576 bytes"),
        ({"tls_cert": cert, "tls_key": encrypted_key(tmp_path)}, r"locked\.key is encrypted"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigurationError, match=message):
            Server({"affine": engine}, http="127.0.0.1:0", grpc=None, **options)  # type: ignore[arg-type]


async def test_a_traditional_encrypted_key_is_refused_without_a_prompt(
    engine: Engine, cert_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """The traditional format's ``Proc-Type: 4,ENCRYPTED`` header: refused, and OpenSSL
    never asked (the pass-phrase callback stands in for its terminal prompt)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "old.key"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    assert b"Proc-Type: 4,ENCRYPTED" in path.read_bytes()
    with pytest.raises(ConfigurationError, match=r"old\.key is encrypted"):
        Server({"affine": engine}, http="127.0.0.1:0", tls_cert=cert_files[0], tls_key=path)


# -- the reported attack, end to end ------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
async def test_slow_clients_cannot_take_a_small_server_down(tmp_path: Path) -> None:
    """``aiodla serve`` under a 256-descriptor limit, 300 connections trickling header
    bytes: they are refused (over the cap of 128, half the limit) or timed out, a good
    client is served within seconds, and the log stays a few lines."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024:  # the test's own 300 connections
        if hard != resource.RLIM_INFINITY and hard < 1024:
            pytest.skip(f"the test needs 1024 descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    model = tmp_path / "affine.bin"
    model.write_bytes(affine_model())

    def small_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiodla", "serve", str(model), "--runtime", "emulated",
        "--http", "127.0.0.1:0", "--grpc", "off", "--header-timeout", "3",
        stderr=asyncio.subprocess.PIPE, preexec_fn=small_limit, env=env,
    )  # fmt: skip
    assert process.stderr is not None
    slow: list[asyncio.StreamWriter] = []
    try:
        line = (await asyncio.wait_for(process.stderr.readline(), 60)).decode()
        port = int(line.split("HTTP port ")[1].split(";")[0].split()[0])
        for _ in range(300):
            slow.append((await asyncio.open_connection("127.0.0.1", port))[1])

        async def trickle() -> None:
            for byte in HEALTH[:-4] * 10:
                for writer in slow:
                    if not writer.is_closing():
                        writer.write(bytes([byte]))
                await asyncio.sleep(0.2)

        trickling = asyncio.ensure_future(trickle())
        started = time.monotonic()
        served = False
        while not served and time.monotonic() - started < 20:
            try:
                served = await healthy(port)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                pass
            if not served:
                await asyncio.sleep(0.2)
        trickling.cancel()
        assert served, "no good client was served within 20 s"
    finally:
        for writer in slow:
            writer.close()
        process.terminate()
        rest = (await asyncio.wait_for(process.stderr.read(), 60)).decode()
        await process.wait()
    lines = rest.splitlines()
    assert len(lines) < 40, rest[-3000:]
    assert any("refusing a connection" in line for line in lines), rest[-3000:]
    assert any("were left out" in line for line in lines), rest[-3000:]  # said at the end
