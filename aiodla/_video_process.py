"""Decoding in a process of its own: ``VideoSource(..., isolation="process")``.

Why. A decoder's thread shares the interpreter's lock with the event loop. Measured on
the GPU machine's host (``benchmarks/bench_nvdec_phases.py``): PyNvVideoCodec's demuxing
and ``Decode`` hold the lock for part of their CPU time, so beside sixteen decoding
threads a thread that sleeps 1 ms wakes 22-50 ms late at p99, and sixteen 1080p30
cameras fall short of 30 frames/s while the DLA cores idle a fifth of the time. A
decoding process has a lock of its own; what is left in the application per picture
is one small message and one copy.

How. :class:`ProcessDecoder` is a decoder (:class:`~aiodla._video_decoders.Decoder`)
like the others, so the source's reader thread, its reconnects and its figures work
unchanged. Each ``open`` starts a fresh interpreter (never a fork:
:mod:`aiodla._isolation._process`) running the named decoder (:func:`serve`), joined by
a socketpair that carries small pickled messages (:mod:`aiodla._isolation._channel`).
The decoding process writes each picture into one of :data:`SLOTS` slots and says
which; the application copies it out (a host picture into the engine's frame buffer, a
device picture into a buffer of its own :class:`~aiodla._video_device_buffers.DevicePool`)
and gives the slot back when the reader asks for the next picture. A host slot is
shared memory (a ``memfd`` sent with ``SCM_RIGHTS``), a device slot device memory the
application opens with CUDA's IPC (NVDEC's pictures; CUDA IPC does not exist on a
Jetson, whose pictures come from GStreamer on the host). So no frame of the
application ever lies in the decoding process's memory, and that process ending (a
close, a crash) can never pull memory from under a frame.

What crosses, each message with the decoding process's CPU seconds since the last:
the stream's codec once open; each slot's memory once; each picture's slot, layout,
size and time; a packet it could not decode; the error that ended the stream (its
reason and whether retrying can help, as the decoder classified it); the stream's end.
A decoding process that dies (a crash in a decoder's native code, the kernel's OOM
killer) or stops talking is a loss the source reconnects from, with a new process. It
dies with the application (``PR_SET_PDEATHSIG``, and its socket's end of file). When
the stream's picture size changes, the decoding process waits for every slot to come
back and announces slots of the new size.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._errors import VideoSourceError
from ._isolation._channel import parse_frames, receive_blocking, receive_with_fds, send_blocking
from ._isolation._process import _kill, _spawn, _wait, die_with
from ._isolation._staging import map_staging
from ._video_address import Address
from ._video_decoders import (
    DecodedStream,
    Decoder,
    DecoderName,
    DecodeTrouble,
    OpenOptions,
    Picture,
    decoder_for,
)
from .runtime._cuda_errors import check_cuda

__all__ = ["SLOTS", "ProcessDecoder", "main", "serve"]

#: Pictures the decoding process may have written that the application has not yet
#: copied out: the one being copied, the next, and one being decoded into.
SLOTS = 3
#: Seconds a fresh decoding process may take to start and open the stream, beyond
#: ``stall_timeout`` (the interpreter, aiodla and the decoder's library load first).
OPEN_GRACE = 30.0
#: Seconds a closing decoding process may take to go before it is killed.
CLOSE_GRACE = 1.0
#: Seconds between looks at the reader's stop while waiting for the decoding process.
_STOP_CHECK = 0.1
_IPC_HANDLE_SIZE = 64  # CUDA_IPC_HANDLE_SIZE
_MAIN = "from aiodla._video_process import main; main()"


@functools.cache
def _cuda() -> Any:
    """CUDA's runtime API, loaded only for device pictures: an application whose
    sources decode on the host never loads CUDA through them."""
    from cuda.bindings import runtime

    return runtime


@functools.cache
def _device_buffers() -> Any:
    """:mod:`aiodla._video_device_buffers` (which loads CUDA), for device pictures only."""
    from . import _video_device_buffers

    return _video_device_buffers


def _loss(address: Address, what: str, reason: str) -> VideoSourceError:
    return VideoSourceError(
        f"video source {address.name!r} {what}", source=address.name, reason=reason, retryable=True
    )


# -- the application's side ------------------------------------------------------------


class ProcessDecoder:
    """Decoder ``name``, run in a process of its own for each opening."""

    def __init__(self, name: DecoderName, stop: threading.Event) -> None:
        self.name = name
        self._stop = stop  # the reader's: set, a wait for the decoding process ends

    def open(self, address: Address, options: OpenOptions) -> DecodedStream:
        return _ProcessStream(self.name, address, options, self._stop)


class _Inbox:
    """Messages from the decoding process, read on the reader thread, with the
    descriptors that came with them."""

    def __init__(self, sock: socket.socket, stop: threading.Event) -> None:
        self._sock = sock
        self._stop = stop
        self._buffer = bytearray()
        self._messages: collections.deque[Any] = collections.deque()
        self.fds: collections.deque[int] = collections.deque()

    def next(self, timeout: float) -> Any:
        """The next message; None when none came within ``timeout`` seconds, or once
        the reader is told to stop; EOFError once the decoding process's end is
        closed."""
        deadline = time.monotonic() + timeout
        while not self._messages:
            left = deadline - time.monotonic()
            if left <= 0 or self._stop.is_set():
                return None
            # In slices: a source closed while its decoding process hangs stops at once.
            ready, _, _ = select.select([self._sock], [], [], min(left, _STOP_CHECK))
            if not ready:
                continue
            data, fds = receive_with_fds(self._sock)
            self.fds.extend(fds)
            if not data:
                raise EOFError("the decoding process closed its end")
            self._buffer += data
            self._messages.extend(parse_frames(self._buffer))
        return self._messages.popleft()

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popleft())


class _OpenedSlots:
    """The application's view of the decoding process's slots: host slots mapped,
    device slots opened with CUDA's IPC, each copied out into memory of the
    application's own (an engine frame buffer; a buffer of a device pool)."""

    def __init__(self, gpu: int) -> None:
        self._gpu = gpu
        # Host slots as arrays over their mappings: a slot is unmapped once dropped.
        self._host: dict[int, np.ndarray[Any, Any]] = {}
        self._device: dict[int, int] = {}
        self._pool: Any = None  # a DevicePool, made with the first device slot

    def add(self, index: int, nbytes: int, where: Any, inbox: _Inbox) -> None:
        """Slot ``index``'s memory, announced by the decoding process: at the start,
        and again, of a new size, when the stream's picture size changed (every slot
        is back with it then)."""
        self._host.pop(index, None)
        if index in self._device:
            _cuda().cudaIpcCloseMemHandle(self._device.pop(index))
        if where == "host":
            self._host[index] = map_staging(inbox.fds.popleft(), nbytes)
            return
        runtime = _cuda()
        check_cuda("cudaSetDevice", runtime.cudaSetDevice(self._gpu))
        handle = runtime.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), bytes(where), _IPC_HANDLE_SIZE)
        flags = runtime.cudaIpcMemLazyEnablePeerAccess
        self._device[index] = int(
            check_cuda("cudaIpcOpenMemHandle", runtime.cudaIpcOpenMemHandle(handle, flags))
        )
        if self._pool is None or self._pool.nbytes != nbytes:
            if self._pool is not None:
                self._pool.close()  # buffers still in frames are freed as those go
            self._pool = _device_buffers().DevicePool(nbytes)

    def write_into(self, index: int, out: np.ndarray[Any, Any]) -> None:
        out[...] = self._host[index][: out.size].reshape(out.shape)

    def copied_out(self, index: int, width: int, height: int) -> Any:
        buffers, pool = _device_buffers(), self._pool
        assert pool is not None, "a device picture before its slot"
        pointer = pool.take()
        array = buffers.DeviceNV12(pool, pointer, width, height)  # gives it back if we fail
        # Whole before the slot goes back to be written again, and before any stream
        # reads the picture.
        buffers.copy_within_device(pointer, self._device[index], width * height * 3 // 2)
        return array

    def close(self) -> None:
        self._host.clear()
        for pointer in self._device.values():
            _cuda().cudaIpcCloseMemHandle(pointer)
        self._device.clear()
        if self._pool is not None:
            self._pool.close()  # buffers still in pictures are freed as those go


class _SlotPicture:
    """A picture the decoding process left in one of its slots."""

    __slots__ = (
        "_index",
        "_slots",
        "color_range",
        "cpu_elsewhere",
        "format",
        "height",
        "on_device",
        "pts",
        "width",
    )

    def __init__(self, slots: _OpenedSlots, message: tuple[Any, ...], cpu: float) -> None:
        _, self._index, self.format, self.color_range, self.width, self.height = message[:6]
        self.pts, self.on_device = message[6], message[7]
        self._slots = slots
        self.cpu_elsewhere = cpu

    def write_into(self, out: np.ndarray[Any, Any]) -> None:
        self._slots.write_into(self._index, out)

    def device_array(self) -> Any:
        return self._slots.copied_out(self._index, self.width, self.height)


class _ProcessStream:
    """One opening of a source, decoded in a fresh process (see the module docstring)."""

    def __init__(
        self, name: DecoderName, address: Address, options: OpenOptions, stop: threading.Event
    ) -> None:
        self._address = address
        self._stop = stop
        # Silence longer than this, while the application waits for a picture, means
        # the decoding process hangs: a live stream's decoder would have reported a
        # stall first; a file's never stalls, but a picture may take a while to come
        # (slow storage, the first picture of a hardware decoder).
        quiet = 2 * options.stall_timeout + CLOSE_GRACE
        self._quiet_limit = quiet if address.live else max(quiet, OPEN_GRACE)
        self._slots = _OpenedSlots(options.gpu)
        self._cpu = 0.0  # the decoding process's CPU not yet handed on with a picture
        self._closed = False
        self._process, self._sock = _spawn(_MAIN)
        self._inbox = _Inbox(self._sock, stop)
        try:
            send_blocking(self._sock, ("open", name, address, options))
            message = self._next(OPEN_GRACE + options.stall_timeout, "did not open")
            if message is None:
                raise _loss(address, "was closed while opening", "closed")
            if message[0] != "opened":
                raise self._ended_with(message)
            self._cpu += message[-1]
            self.codec: str = message[1]
        except BaseException:
            self.close()
            raise

    def _next(self, timeout: float, what: str) -> Any:
        try:
            message = self._inbox.next(timeout)
        except (EOFError, OSError):
            status = self._exit_status()
            raise _loss(
                self._address,
                f"lost its decoding process (exit status {status})",
                "decoder process ended",
            ) from None
        if message is None and self._stop.is_set():
            return None  # the source is closing: nothing more is wanted
        if message is None:
            raise _loss(
                self._address,
                f"{what}: its decoding process said nothing for {timeout:g} s",
                "stalled",
            )
        return message

    def _exit_status(self) -> int | None:
        try:
            return _wait(self._process, CLOSE_GRACE)
        except subprocess.TimeoutExpired:
            return None

    def _ended_with(self, message: tuple[Any, ...]) -> BaseException:
        if message[0] == "failed":
            _, text, reason, retryable, _ = message
            return VideoSourceError(
                text, source=self._address.name, reason=reason, retryable=retryable
            )
        # "crashed": a bug in the decoder, as it would have ended a reader thread.
        return RuntimeError(f"video source {self._address.name!r}'s decoder failed: {message[1]}")

    def pictures(self) -> Iterator[Picture | DecodeTrouble]:
        while True:
            message = self._next(self._quiet_limit, "stalled")
            if message is None:
                return
            kind = message[0]
            if kind == "slot":
                self._slots.add(message[1], message[2], message[3], self._inbox)
                continue
            self._cpu += message[-1]
            if kind == "picture":
                picture = _SlotPicture(self._slots, message, self._cpu)
                self._cpu = 0.0
                self.codec = message[8]  # some decoders know it only once decoding
                try:
                    yield picture
                finally:  # copied out or dropped: the slot may be written again
                    self._give_back(message[1])
            elif kind == "trouble":
                yield DecodeTrouble(message[1], self._cpu)
                self._cpu = 0.0
            elif kind == "ended":
                return
            else:
                raise self._ended_with(message)

    def _give_back(self, index: int) -> None:
        if self._closed:
            return
        # A process gone already: the next read says so, as a loss.
        with contextlib.suppress(OSError):
            send_blocking(self._sock, ("free", index))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The application's mappings first: nothing of it may outlive the process.
        self._slots.close()
        with contextlib.suppress(OSError):  # gone already
            send_blocking(self._sock, ("close",))
        if self._exit_status() is None:
            _kill(self._process)
            _wait(self._process)
        self._sock.close()
        self._inbox.close()


# -- the decoding process's side ---------------------------------------------------------


class _Slots:
    """The decoding process's slots, all of the first picture's size and place (host or
    device), each announced to the application once; a slot is taken to write a
    picture into and comes back when the application says so."""

    def __init__(self, send: Callable[..., None], nbytes: int, on_device: bool, gpu: int) -> None:
        self.nbytes = nbytes
        self.on_device = on_device
        self._host: list[np.ndarray[Any, Any]] = []  # unmapped once dropped
        self._device: list[int] = []
        if on_device:
            check_cuda("cudaSetDevice", _cuda().cudaSetDevice(gpu))
        for index in range(SLOTS):
            if on_device:
                pointer = int(check_cuda("cudaMalloc", _cuda().cudaMalloc(nbytes)))
                self._device.append(pointer)
                handle = check_cuda("cudaIpcGetMemHandle", _cuda().cudaIpcGetMemHandle(pointer))
                send(("slot", index, nbytes, ctypes.string_at(handle.getPtr(), _IPC_HANDLE_SIZE)))
            else:
                fd = os.memfd_create("aiodla-video-slot", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, nbytes)
                    send(("slot", index, nbytes, "host"), fds=(fd,))
                except BaseException:
                    os.close(fd)
                    raise
                self._host.append(map_staging(fd, nbytes))  # (closes the descriptor)

    def fill(self, index: int, picture: Picture) -> None:
        shape = (picture.height * 3 // 2, picture.width)
        if not self.on_device:
            picture.write_into(self._host[index][: shape[0] * shape[1]].reshape(shape))
            return
        interface = picture.device_array().__cuda_array_interface__
        dense = interface.get("strides") in (None, (shape[1], 1))
        if tuple(interface["shape"]) != shape or not dense:
            raise TypeError(f"a device picture must be {shape} dense rows, got {interface}")
        _device_buffers().copy_within_device(self._device[index], interface["data"][0], self.nbytes)

    def close(self) -> None:
        self._host.clear()
        for pointer in self._device:
            _cuda().cudaFree(pointer)


def _listen(
    sock: socket.socket, free: queue.SimpleQueue[int | None], stop: threading.Event
) -> None:
    """The application's word: slots given back, and when to stop (its close, or its
    end of the socket)."""
    buffer = bytearray()
    try:
        while True:
            try:
                data = sock.recv(1 << 12)
            except OSError:
                return
            if not data:
                return
            buffer += data
            for message in parse_frames(buffer):
                if message[0] == "free":
                    free.put(message[1])
                elif message[0] == "close":
                    return
    finally:  # whatever ended the listening (a message it could not read included)
        stop.set()
        free.put(None)


def serve(sock: socket.socket, decoders: Callable[[DecoderName], Decoder] = decoder_for) -> None:
    """The decoding process's work: open the stream the application names, then send
    it each picture, until the stream ends, fails, or the application says stop."""
    _, name, address, options = receive_blocking(sock)
    free: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    stop = threading.Event()
    sending = threading.Lock()
    spent = [0.0]  # from the process's start: its interpreter and imports count too

    def send(message: tuple[Any, ...], fds: tuple[int, ...] = ()) -> None:
        now = time.process_time()
        if message[0] != "slot":
            message, spent[0] = (*message, now - spent[0]), now
        with sending:
            send_blocking(sock, message, fds)

    threading.Thread(target=_listen, args=(sock, free, stop), daemon=True).start()
    if name == "nvdec":
        _block_on_waits(options.gpu)
    try:
        stream = decoders(name).open(address, options)
    except VideoSourceError as exc:
        send(("failed", str(exc), exc.reason, exc.retryable))
        return
    except Exception as exc:
        send(("crashed", f"{type(exc).__name__}: {address.redact(str(exc))}"))
        return
    slots: _Slots | None = None
    try:
        send(("opened", stream.codec))
        for item in stream.pictures():
            if stop.is_set():
                return
            if isinstance(item, DecodeTrouble):
                send(("trouble", item.message))
                continue
            nbytes = item.height * 3 // 2 * item.width
            if slots is None or nbytes != slots.nbytes or item.on_device != slots.on_device:
                # The first picture, or the stream's size changed: slots of this size,
                # once the application has given every old one back.
                if slots is not None:
                    if not _all_back(free):
                        return
                    slots.close()
                    slots = None
                slots = _new_slots(address, send, nbytes, item.on_device, options.gpu)
                for number in range(SLOTS):
                    free.put(number)
            index = free.get()  # None: the application said stop
            if index is None:
                return
            slots.fill(index, item)
            send(("picture", index, item.format, item.color_range, item.width, item.height,
                  item.pts, item.on_device, stream.codec))  # fmt: skip
        send(("ended",))
    except VideoSourceError as exc:
        send(("failed", str(exc), exc.reason, exc.retryable))
    except OSError as exc:
        if not stop.is_set():  # the application still listens: tell it
            send(("crashed", f"{type(exc).__name__}: {address.redact(str(exc))}"))
    except Exception as exc:
        send(("crashed", f"{type(exc).__name__}: {address.redact(str(exc))}"))
    finally:
        # Nothing raised here may reach this process's stderr unredacted, nor stop
        # the other release.
        with contextlib.suppress(Exception):
            stream.close()
        if slots is not None:
            with contextlib.suppress(Exception):
                slots.close()


def _block_on_waits(gpu: int) -> None:
    """Have this process's CUDA context sleep in its waits (each picture's copy is
    waited for) rather than spin: CUDA may spin by default while it has fewer contexts
    than CPUs (sixteen NVDEC decoding processes kept 6.2 of an H100 host's CPUs busy
    before this, 4.9 with it). Set before anything creates the context; where one
    exists already, it stays as it is."""
    _cuda().cudaSetDevice(gpu)
    _cuda().cudaSetDeviceFlags(_cuda().cudaDeviceScheduleBlockingSync)


def _all_back(free: queue.SimpleQueue[int | None]) -> bool:
    """Wait until the application has given every slot back; False if told to stop."""
    return all(free.get() is not None for _ in range(SLOTS))


def _new_slots(
    address: Address, send: Callable[..., None], nbytes: int, on_device: bool, gpu: int
) -> _Slots:
    """Slots for pictures of ``nbytes``; memory that cannot be had now (a full device,
    no shared memory left) is a loss to retry, not the source's end."""
    try:
        return _Slots(send, nbytes, on_device, gpu)
    except OSError:
        raise  # the socket to the application: not the memory
    except Exception as exc:
        raise _loss(address, f"could not allocate its picture slots: {exc}", "no memory") from None


def main() -> None:
    """Entry point: ``python -c '...main()' CHANNEL_FD PARENT_PID``."""
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    die_with(parent)
    sock = socket.socket(fileno=fd)
    try:
        serve(sock)
    except (EOFError, OSError):
        pass  # the application went away: nobody to tell
    finally:
        sock.close()
