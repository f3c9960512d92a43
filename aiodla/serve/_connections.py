"""The HTTP front's connections, from accept to close: how many may be open, how long
a client may take to finish its TLS handshake and to send a request's headers, and
what it is told when it is refused.

The front listens with its own asyncio server rather than aiohttp's site, so that each
connection is counted from the moment it is accepted (a TLS connection included, while
its handshake runs), and the TLS handshake runs under limits of its own:

- **Connections**: at most ``max_connections`` open at once (and never more than half
  the process's open-file limit, so the gRPC front, the engines and the log keep
  descriptors). One more is answered 503 ``{"error": ...}`` and closed (over TLS,
  closed before any handshake: no HTTP can be spoken yet).
- **Headers**: a request's headers must have arrived within ``header_timeout``
  seconds of their first byte, and a new connection's first request within as long;
  else the answer is 408 ``{"error": ...}`` and the connection is closed. Time spent
  handling a request (its body has its own timeout, ``body_timeout``) is not counted;
  an idle keep-alive connection is closed after :data:`KEEPALIVE_TIMEOUT`.
- **TLS handshakes**: each must finish within ``header_timeout``, at most
  :data:`MAX_HANDSHAKES` run at once (the others wait, reading nothing). asyncio gives
  each TLS connection a 256 KiB buffer from its first byte, so unbounded handshakes
  that never finish hold 256 KiB each: 8,000 held about a GB, which the C allocator
  then kept.
- **Errors**: aiohttp answers a request its parser refuses (a bad request line or
  header, a bad ``Content-Length``, ...) through its request handler's
  ``handle_error``, in plain text, logging a traceback each time; the handler here
  answers ``{"error": ...}`` with the same status, and logs one line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import sys
from collections.abc import Callable
from http import HTTPStatus

from aiohttp import web

__all__ = [
    "HEADER_TIMEOUT",
    "KEEPALIVE_TIMEOUT",
    "MAX_CONNECTIONS",
    "MAX_HANDSHAKES",
    "JsonErrorHandler",
    "Listener",
    "connection_cap",
]

logger = logging.getLogger("aiodla.serve")

#: Connections open at once by default (see :func:`connection_cap`).
MAX_CONNECTIONS = 1024
#: Seconds a request's headers (and a TLS handshake) may take by default.
HEADER_TIMEOUT = 10.0
#: TLS handshakes that run at once; the others wait their turn.
MAX_HANDSHAKES = 64
#: Seconds an idle keep-alive connection stays open.
KEEPALIVE_TIMEOUT = 75.0


def connection_cap(max_connections: int) -> int:
    """The connections the front takes: ``max_connections``, and at most half the
    process's open-file limit (where the platform has one)."""
    try:
        import resource
    except ImportError:  # (Windows: no such limit to respect)
        return max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft // 2))


def json_response(status: int, message: str) -> web.Response:
    response = web.json_response({"error": message}, status=status)
    response.force_close()
    return response


def _raw_answer(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 answer, for a connection no request handler serves."""
    body = json.dumps({"error": message}).encode()
    phrase = HTTPStatus(status).phrase
    return (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


class JsonErrorHandler(web.RequestHandler):
    """aiohttp's request handler, answering the errors it handles itself (its parser's
    refusals, a handler that failed outside the application's middlewares) as
    ``{"error": message}`` with one log line, not plain text with a traceback."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # an answer began: nothing more can be said
            raise ConnectionError("the response had begun; the connection is closed")
        phrase = HTTPStatus(status).phrase
        detail = " ".join(str(message or exc or "").split())
        if status >= 500:
            logger.error("HTTP %d from %s: %s", status, request.remote, detail or phrase)
        else:
            logger.info("HTTP %d to %s: %s", status, request.remote, detail or phrase)
        return json_response(status, f"{phrase}: {detail}" if detail else phrase)


class Listener:
    """The front's listening socket and its open connections."""

    def __init__(
        self,
        handler: Callable[[], web.RequestHandler],
        *,
        tls: ssl.SSLContext | None,
        max_connections: int,
        header_timeout: float,
    ) -> None:
        self.handler = handler
        self.tls = tls
        self.max_connections = connection_cap(max_connections)
        self.header_timeout = header_timeout
        self.handshakes = asyncio.Semaphore(MAX_HANDSHAKES)
        self._server: asyncio.AbstractServer | None = None
        # Every connection from accept to close; and which one a request's transport is.
        self.connections: set[_Connection] = set()
        self.by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def abort_unserved(self) -> None:
        """Close the connections no request handler has yet (a handshake or the wait
        for one still running): aiohttp's shutdown sees only the others."""
        for connection in list(self.connections):
            if connection.handler is None:
                connection.abort()

    def request_started(self, transport: asyncio.BaseTransport | None) -> None:
        connection = self.by_transport.get(transport) if transport is not None else None
        if connection is not None:
            connection.request_started()

    def request_finished(self, transport: asyncio.BaseTransport | None) -> None:
        connection = self.by_transport.get(transport) if transport is not None else None
        if connection is not None:
            connection.request_finished()


def _hold_reading(transport: asyncio.Transport) -> None:
    transport.resume_reading()
    transport.pause_reading()


class _Connection(asyncio.Protocol):
    """One accepted connection: counted, TLS set up under the handshake limits, then
    served by aiohttp's request handler, whose reads it passes on while it times the
    headers. The same object is the protocol of the TCP transport and, over TLS, of
    the TLS transport that replaces it."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self.handler: web.RequestHandler | None = None
        self._raw: asyncio.Transport | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False
        self._counted = False
        self._setup: asyncio.Task[None] | None = None
        self._early: list[bytes] = []
        self._tls_begun = False  # whether start_tls has taken the TCP transport

    # -- from the transport ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if self._raw is not None:  # (start_tls does not call it; a guard, not a path)
            return
        listener = self._listener
        self._raw = transport
        listener.connections.add(self)
        self._counted = True
        if len(listener.connections) > listener.max_connections:
            logger.warning(
                "refusing a connection: %d are open (max_connections=%d)",
                len(listener.connections) - 1,
                listener.max_connections,
            )
            if listener.tls is None:
                transport.write(
                    _raw_answer(
                        503,
                        f"the server holds {listener.max_connections} connections, its "
                        "limit; retry later",
                    )
                )
                transport.close()
            else:
                transport.abort()
            return
        if listener.tls is None:
            self._serve(transport)
            return
        # Nothing is read until the handshake starts: the bytes are TLS's.
        transport.pause_reading()
        if sys.version_info < (3, 11):
            # 3.10's transport starts reading just after connection_made, paused or not
            # (its _add_reader ignores the pause); the reader added, pausing again
            # removes it, and cancels a read already queued for the next turn.
            self._loop.call_soon(_hold_reading, transport)
        self._setup = self._loop.create_task(self._handshake(transport, listener.tls))

    def data_received(self, data: bytes) -> None:
        if self.handler is None:
            if self._setup is None:  # refused: its answer is on its way out
                return
            if not self._tls_begun:  # TLS bytes, read before the handshake could take them
                logger.warning("closing a TLS connection: its first bytes came too early")
                self.abort()
                return
            # Over TLS, bytes that came with the end of the handshake, before start_tls
            # returned: the handler reads them first.
            self._early.append(data)
            return
        if not self._busy and self._timer is None:
            self._arm()  # the first byte of a request's headers
        self.handler.data_received(data)

    def eof_received(self) -> None:
        if self.handler is not None:
            self.handler.eof_received()

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._release()
        if self._setup is not None and not self._setup.done():
            self._setup.cancel()
        if self.handler is not None:
            self.handler.connection_lost(exc)

    # -- TLS --------------------------------------------------------------------------------

    async def _handshake(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        timeout = self._listener.header_timeout
        try:
            await asyncio.wait_for(self._start_tls(raw, context), timeout)
        except asyncio.CancelledError:
            self._release()
            raw.abort()
            raise
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError) as exc:
            if isinstance(exc, asyncio.TimeoutError):
                logger.info("closing a TLS connection: no handshake within %g s", timeout)
            else:
                logger.info("TLS handshake failed: %s", " ".join(str(exc).split()))
            # start_tls closed the connection; its protocol (this) is not told.
            self._release()
            raw.abort()

    async def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        async with self._listener.handshakes:
            if raw.is_closing():  # the client left while it waited its turn
                raise ConnectionError("the connection closed before its handshake")
            self._tls_begun = True  # (start_tls takes the transport before it first waits)
            tls = await self._loop.start_tls(
                raw,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=self._listener.header_timeout,
            )
        if tls is None:  # (the transport was closing)
            raise ConnectionError("the connection closed during the handshake")
        self._serve(tls)

    # -- HTTP -------------------------------------------------------------------------------

    def _serve(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._listener.by_transport[transport] = self
        self.handler = self._listener.handler()
        self.handler.connection_made(transport)
        self._arm()  # the first request's headers
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def request_started(self) -> None:
        self._busy = True
        self._disarm()

    def request_finished(self) -> None:
        self._busy = False

    def _arm(self) -> None:
        self._timer = self._loop.call_later(self._listener.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        transport = self._transport
        if self._busy or transport is None or transport.is_closing():
            return
        timeout = self._listener.header_timeout
        logger.info("closing a connection: a request's headers took over %g s", timeout)
        transport.write(
            _raw_answer(
                408,
                f"the request's headers did not arrive within {timeout:g} s "
                "(header_timeout); the connection is closed",
            )
        )
        transport.close()

    def abort(self) -> None:
        for transport in (self._transport, self._raw):
            if transport is not None:
                transport.abort()

    def _release(self) -> None:
        """Count the connection closed: once, whichever way it ends."""
        self._disarm()
        if not self._counted:
            return
        self._counted = False
        self._listener.connections.discard(self)
        if self._transport is not None:
            self._listener.by_transport.pop(self._transport, None)
