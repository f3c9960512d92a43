"""The control channel between the application and its worker process.

One Unix stream socket (a ``socketpair``) carries small pickled messages, each framed
by its length. Tensors never travel here: they are in shared staging
(:mod:`._staging`). Both ends are read by their event loop itself
(``loop.add_reader``), so a batch of completions reaches the application's loop with
no thread hop; a writer that finds the socket full waits for it with ``add_writer``
instead of blocking the loop.

The worker hands over its staging memory as a file descriptor (``SCM_RIGHTS``) with
the message that says it is ready: :attr:`Channel.fds` collects what arrives. The
application hands over its frame buffers so (:mod:`._shared_frames`): a message's
descriptors go with its first byte.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import os
import pickle
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "Channel",
    "frame",
    "parse_frames",
    "receive_blocking",
    "receive_with_fds",
    "send_blocking",
]

_HEADER = struct.Struct("<I")
_READ_SIZE = 1 << 16
# Room for the few descriptors a message carries (the worker sends one; the
# application's frame buffers go 16 to a message).
_FD_SPACE = socket.CMSG_SPACE(16 * array.array("i").itemsize)


def frame(message: Any) -> bytes:
    """``message`` as it travels: its length, then its pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def send_blocking(sock: socket.socket, message: Any, fds: Sequence[int] = ()) -> None:
    """Send one message on a blocking socket (the worker's handshake, its last words)."""
    data = frame(message)
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


def receive_blocking(sock: socket.socket) -> Any:
    """Read one message from a blocking socket; EOFError when the peer closed it."""
    header = _read_exactly(sock, _HEADER.size)
    return pickle.loads(_read_exactly(sock, _HEADER.unpack(header)[0]))


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    parts = bytearray()
    while len(parts) < count:
        chunk = sock.recv(count - len(parts))
        if not chunk:
            raise EOFError("the peer closed the channel")
        parts += chunk
    return bytes(parts)


def receive_with_fds(sock: socket.socket, flags: int = 0) -> tuple[bytes, list[int]]:
    """One read of ``sock`` and the descriptors that came with it (``recv``'s errors)."""
    data, ancillary, _, _ = sock.recvmsg(_READ_SIZE, _FD_SPACE, flags)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def parse_frames(buffer: bytearray) -> list[Any]:
    """The whole messages at the start of ``buffer``, removed from it."""
    messages = []
    start = 0
    while len(buffer) - start >= _HEADER.size:
        (length,) = _HEADER.unpack_from(buffer, start)
        end = start + _HEADER.size + length
        if end > len(buffer):
            break
        messages.append(pickle.loads(memoryview(buffer)[start + _HEADER.size : end]))
        start = end
    del buffer[:start]
    return messages


class Channel:
    """A message channel on an event loop: ``send`` never blocks, ``on_messages`` gets
    every message one read found (so a burst is handled as one batch), ``on_closed``
    is called once when the peer hangs up or the socket fails."""

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        on_messages: Callable[[list[Any]], None],
        on_closed: Callable[[str], None],
    ) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._loop = loop
        self._on_messages = on_messages
        self._on_closed = on_closed
        self._incoming = bytearray()
        self._outgoing = bytearray()
        # Where in _outgoing a message with descriptors starts, and them (see _send_some).
        self._marks: collections.deque[tuple[int, array.array[int]]] = collections.deque()
        self._writing = False
        self.closed = False
        self.fds: list[int] = []  # descriptors received and not yet taken
        loop.add_reader(sock.fileno(), self._readable)

    def receive_with(
        self, on_messages: Callable[[list[Any]], None], on_closed: Callable[[str], None]
    ) -> None:
        """Hand what arrives from now on to these (the supervisor takes a worker's
        channel over from its opening handshake)."""
        self._on_messages = on_messages
        self._on_closed = on_closed

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        """Queue ``message`` (with ``fds``, which stay the caller's) and write what the
        socket takes now."""
        if self.closed:
            return  # the loss is being handled already; nothing is listening
        if fds:
            self._marks.append((len(self._outgoing), array.array("i", fds)))
        self._outgoing += frame(message)
        if not self._writing:
            self._flush()

    def _send_some(self) -> None:
        """One write from the head of what is queued, stopping short of the next
        message with descriptors, which go with its first byte (``socket.send``'s
        errors; nothing is sent when it raises)."""
        marks, outgoing = self._marks, self._outgoing
        if not marks:
            sent = self._sock.send(outgoing)
        elif marks[0][0] == 0:
            end = marks[1][0] if len(marks) > 1 else len(outgoing)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, marks[0][1])]
            sent = self._sock.sendmsg([outgoing[:end]], rights)
            marks.popleft()
        else:
            sent = self._sock.send(outgoing[: marks[0][0]])
        del outgoing[:sent]
        if marks:
            self._marks = collections.deque((at - sent, fds) for at, fds in marks)

    def _flush(self) -> None:
        try:
            while self._outgoing:
                self._send_some()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            # The peer is gone. What it said before it went (why it went) is still to
            # be read: that first, on the loop's next turn (not inside the sender).
            self._outgoing.clear()
            self._marks.clear()
            self._loop.call_soon(self._last_words, f"the control channel failed: {exc}")
            return
        if self._outgoing and not self._writing:
            self._writing = True
            self._loop.add_writer(self._sock.fileno(), self._writable)

    def _writable(self) -> None:
        self._writing = False
        self._loop.remove_writer(self._sock.fileno())
        if not self.closed:
            self._flush()

    def _last_words(self, why: str) -> None:
        if not self.closed:
            self._readable()  # hangs up itself at the end of what the peer sent
            self._hang_up(why)

    def read_now(self) -> None:
        """Handle what has arrived without waiting for the loop to say so."""
        if not self.closed:
            self._readable()

    def _readable(self) -> None:
        hung_up = self._receive()
        messages = self._parse()
        if messages:
            self._on_messages(messages)
        if hung_up is not None:
            self._hang_up(hung_up)

    def _receive(self) -> str | None:
        """Read what the socket holds into the buffer; why the peer is gone, if it is."""
        while True:
            try:
                data, fds = receive_with_fds(self._sock)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                return f"the control channel failed: {exc}"
            self.fds.extend(fds)
            if not data:
                return "the worker closed the control channel"
            self._incoming += data
            if len(data) < _READ_SIZE:
                return None

    def call_blocking(self, message: Any, is_reply: Callable[[Any], bool], timeout: float) -> Any:
        """Send ``message`` and block this thread until the message ``is_reply`` picks
        arrives; the others that arrive meanwhile go to ``on_messages`` on the loop's
        next iteration, in order (before anything the loop reads later).

        For aiodla.testing's controls, which act before the test's next line: called on
        the loop's thread, so no reader competes. ``TimeoutError`` after ``timeout``
        seconds; ``EOFError`` if the peer is gone (the loop's reader then sees it too).
        """
        if self.closed:
            raise EOFError("the control channel is closed")
        self._outgoing += frame(message)
        deadline = time.monotonic() + timeout
        others: list[Any] = []
        reply: list[Any] = []
        hung_up: str | None = None
        try:
            while True:
                if self._outgoing and hung_up is None:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        self._send_some()
                # (every message parsed is kept: those read after the reply as well)
                for arrived in self._parse():
                    (reply if not reply and is_reply(arrived) else others).append(arrived)
                if reply:
                    return reply[0]
                if hung_up is not None:
                    raise EOFError(hung_up)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no answer from the worker within {timeout:g} s")
                writing = [self._sock] if self._outgoing else []
                select.select([self._sock], writing, [], remaining)
                hung_up = self._receive()
        except OSError as exc:
            if isinstance(exc, TimeoutError):
                raise
            raise EOFError(f"the control channel failed: {exc}") from None
        finally:
            if others:
                self._loop.call_soon(self._on_messages, others)

    def _parse(self) -> list[Any]:
        return parse_frames(self._incoming)

    def _hang_up(self, why: str) -> None:
        if self.closed:
            return
        self.close()
        self._on_closed(why)

    def flush_blocking(self, timeout: float) -> None:
        """Write what is still queued, waiting up to ``timeout`` (last words)."""
        if self.closed or not self._outgoing:
            return
        with contextlib.suppress(OSError):
            self._sock.settimeout(timeout)
            while self._outgoing:
                self._send_some()
        self._outgoing.clear()
        self._marks.clear()

    def abandon(self) -> None:
        """Close the socket without the loop (which is gone: an engine collected
        unclosed); the loop's watch of it goes with the loop."""
        self.closed = True
        self._sock.close()

    def close(self) -> None:
        """Stop watching the socket and close it (and any descriptor not taken)."""
        if self.closed:
            return
        self.closed = True
        fileno = self._sock.fileno()
        if fileno >= 0:
            self._loop.remove_reader(fileno)
            if self._writing:
                self._loop.remove_writer(fileno)
        self._writing = False
        self._sock.close()
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
