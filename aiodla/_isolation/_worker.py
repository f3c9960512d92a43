"""The worker process of ``isolation="process"``: the runtime, the CUDA context, every
cuDLA handle and the poller live here, never in the application's process.

It is started as a fresh interpreter (never forked from a process holding CUDA state)
with one end of the control channel. It opens the model with the ordinary device
layer (:class:`~aiodla._local_device.LocalDevice`, its staging in shared memory), says it is ready,
then submits what the application sends as it arrives (a thread blocked on the
channel, awake around its one task's end at light load: ``AWAKE_BEFORE``) and sends
back what the ordinary poller finds done, one message per batch.

It ends when told to close, when the application's end of the channel closes, when its
parent dies (``PR_SET_PDEATHSIG``: the kernel kills it), and when its CUDA context is
lost: then it says why and exits with :data:`CONTEXT_LOST_EXIT` at once, since nothing
can be released in a poisoned context (the process's end reclaims it all).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast, runtime_checkable

from .._device import device_error, is_sticky
from .._errors import AiodlaError
from .._local_device import LocalDevice
from .._options import EngineOptions
from .._poller import Poller
from ..runtime._protocol import FaultControls, HostRegistration, Runtime
from ..runtime._select import load_library, loaded_libraries, select_runtime
from ._channel import frame, parse_frames, receive_blocking, receive_with_fds, send_blocking
from ._process import die_with
from ._shared_frames import MappedFrames
from ._staging import SharedStaging, StagingRuntime

__all__ = [
    "CONTEXT_LOST_EXIT",
    "FAULT_INJECTIONS",
    "LEAKED_EXIT",
    "OPEN_FAILED_EXIT",
    "main",
]

logger = logging.getLogger("aiodla")

CONTEXT_LOST_EXIT = 3  # the CUDA context broke: this process must be replaced
OPEN_FAILED_EXIT = 4  # the model could not be opened (the application was told why)
LEAKED_EXIT = 5  # closed, but the runtime still counts live handles (a bug in aiodla)
# Test controls a worker's emulated runtime accepts over the channel (see
# aiodla._isolation.inject_fault): fault injection happens where the runtime is.
FAULT_INJECTIONS = frozenset({"fail_next_task", "hang_core", "poison", "fail_call"})
# What aiodla.testing's controls may call on the worker's emulated runtime ("control"
# messages): the fault injections, gates, and the counters tests read.
RUNTIME_CONTROLS = FAULT_INJECTIONS | {"hold", "core_tasks", "core_busy_time", "live_handles"}
# ... and before the model opens, those armed before the engine opened (and the
# compute function bound to the model).
SETUP_CONTROLS = frozenset({"fail_call", "fail_next_task", "hang_core", "bind_compute"})
# ... and on a gate the worker holds for them.
GATE_CONTROLS = frozenset({"release", "held", "released"})
# Light load (the worker holds one task): the application's next submission follows
# that task's completion by a round trip. The receiving thread waits for it awake from
# AWAKE_BEFORE ahead of the task's expected end until AWAKE_AFTER past its completion
# (a blocked thread's wake-up would add to every request's latency), never longer
# than AWAKE_AT_MOST in all; otherwise it blocks.
AWAKE_BEFORE = 0.0001
AWAKE_AFTER = 0.0003
AWAKE_AT_MOST = 0.002


@runtime_checkable
class _StandinFaults(Protocol):
    """What a loaded GPU stand-in lets a test inject under the CUDA runtime."""

    def fail_next_task(self, *args: Any, **kwargs: Any) -> None: ...
    def hang_core(self, *args: Any, **kwargs: Any) -> None: ...


def runtime_controls(runtime: Runtime) -> dict[str, Callable[..., Any]]:
    """The test controls the worker's runtime answers to, by name (none but the
    emulated runtime's)."""
    if not isinstance(runtime, FaultControls):
        return {}
    return {
        "fail_next_task": runtime.fail_next_task,
        "hang_core": runtime.hang_core,
        "poison": runtime.poison,
        "fail_call": runtime.fail_call,
        "hold": runtime.hold,
        "core_tasks": runtime.core_tasks,
        "core_busy_time": runtime.core_busy_time,
        "live_handles": runtime.live_handles,
        "bind_compute": runtime.bind_compute,
    }


def main() -> None:
    """Entry point: ``python -c '...main()' CHANNEL_FD PARENT_PID``."""
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    die_with(parent)
    sock = socket.socket(fileno=fd)
    try:
        opened = _open(sock)
    except EOFError:
        return
    if opened is None:
        os._exit(OPEN_FAILED_EXIT)
    cores, runtime, staging, frames = opened
    WorkerServer(sock, cores, runtime, frames).serve()
    cores.release()
    if frames is not None:  # unlocked before the runtime goes
        frames.close()
    leaked = left_alive(runtime)
    runtime.close()
    staging.close()
    if leaked:
        print(f"aiodla worker: handles left alive at close: {leaked}", file=sys.stderr)
        sys.exit(LEAKED_EXIT)


def left_alive(runtime: Runtime) -> dict[str, int]:
    """Handle accounting once the cores are released: what the emulated runtime, or
    the GPU stand-in under the CUDA runtime, still counts alive. The exit status tells
    the application (its supervisor logs it, tests assert on it)."""
    counts: dict[str, int] = {}
    for source in (runtime, *loaded_libraries().values()):
        for name in ("live_handles", "live_resources"):
            count = getattr(source, name, None)
            if count is not None:
                counts.update(count())
    return {name: value for name, value in counts.items() if value}


def _open(
    sock: socket.socket,
) -> tuple[LocalDevice, Runtime, SharedStaging, MappedFrames | None] | None:
    """Open the model the application sends; tell it the layout, or why not."""
    model, runtime_choice, fields, libraries, setup = receive_blocking(sock)
    runtime: Runtime | None = None
    try:
        for path in libraries:  # before anything binds cuda.bindings.cudla to a library
            load_library(path)
        # The runtime is made here, so the trust goes to it (the cores then get it made).
        trust = bool(fields.pop("trust_compute", False))
        runtime, _ = select_runtime(runtime_choice, model, trust_compute=trust)
        controls = runtime_controls(runtime)
        for name, args, kwargs in setup:  # aiodla.testing's, armed before the open
            if name not in SETUP_CONTROLS or name not in controls:
                raise AiodlaError(f"the worker's {runtime.name} runtime has no control {name!r}")
            controls[name](*args, **kwargs)
        staging = SharedStaging(runtime)
        cores = LocalDevice.open(model, StagingRuntime(runtime, staging), EngineOptions(**fields))
        frames = None
        if cores.path.converts_on_device:  # (host conversion packs frames in the application)
            # (SharedStaging made sure the runtime registers host memory)
            frames = MappedFrames(cast(HostRegistration, runtime), cores.path.zero_copy)
            cores.path.use_frame_buffers(frames)
    except Exception as exc:  # (what the open made is released already)
        if runtime is not None:
            runtime.close()
        send_blocking(sock, ("open_failed", transportable(exc)))
        return None
    layout = [
        [staging.layout[binding.host.ptr] for binding in (*slot.inputs, *slot.outputs)]
        for slot in cores.slots
    ]
    path = cores.path
    ready = {
        # The application stages what the worker's path reads: DLA bytes (host
        # conversion), or the caller's bytes for the conversion kernels (device).
        "device_path": path.converts_on_device,
        "fused": path.fused,
        "pid": os.getpid(),
        "runtime": runtime.name,
        "inputs": cores.inputs,
        "outputs": cores.outputs,
        "stated_service_time": cores.stated_service_time,
        "staging_size": staging.size,
        "layout": layout,
    }
    send_blocking(sock, ("ready", ready), [staging.fd])
    return cores, runtime, staging, frames


def transportable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling unchanged in kind, else an AiodlaError that
    names it (an exception whose constructor takes keywords does not)."""
    try:
        copy = pickle.loads(pickle.dumps(error))
    except Exception:
        copy = None
    if type(copy) is type(error):
        return error
    return AiodlaError(f"{type(error).__name__}: {error}")


class _Direct:
    """What the worker's poller takes for its loop: it has none. A batch is handled on
    the poller's thread at once (sent from there: a hop to another thread would add a
    wake-up to every completion); a failure too (it ends the process)."""

    def call_soon_threadsafe(self, callback: Any, argument: Any) -> None:
        callback(argument)


class WorkerServer:
    """The worker's service: submissions in, completion batches out.

    No event loop: the main thread blocks on the channel and submits what arrives as
    soon as it arrives (an event loop's wake-up and dispatch cost tens of microseconds
    per message on the light-load path); the poller's thread sends the completions.
    Both send under ``_send_lock``, each message whole.
    """

    _poller: Poller  # made as it starts serving

    def __init__(
        self,
        sock: socket.socket,
        cores: LocalDevice,
        runtime: Runtime,
        frames: MappedFrames | None = None,
    ) -> None:
        self._sock = sock
        self._device = cores
        self._runtime = runtime
        self._frames = frames  # the application's frame buffers, mapped here
        self._fds: list[int] = []  # descriptors received, for the "frames" messages
        self._slots = cores.slots
        self._index = {id(slot): number for number, slot in enumerate(cores.slots)}
        self._failed: dict[int, BaseException] = {}  # slots whose submission failed
        self._stopped = False
        self._send_lock = threading.Lock()
        # Gates put up by the application's test controls, by the number it gave them.
        self._gates: dict[int, Any] = {}
        # Slots submitted and not yet delivered, and when the last batch went (for
        # the receiving thread's wait at light load: _receive).
        self._watched: set[Any] = set()
        self._delivered_at = 0.0

    def serve(self) -> None:
        """Serve until told to close or the application hangs up (main thread)."""
        sock = self._sock
        sock.setblocking(True)
        # (the worker has no event loop: its poller's batches go out on its own thread)
        direct = cast(asyncio.AbstractEventLoop, _Direct())
        self._poller = self._device.poller(direct, self._deliver, self._context_lost)
        self._poller.start()
        incoming = bytearray()
        try:
            while not self._stopped:
                try:
                    data = self._receive()
                except InterruptedError:
                    continue
                except OSError:
                    break  # the channel failed: nobody is left to serve
                if not data:
                    break  # the application closed its end, or is gone
                incoming += data
                self._on_messages(parse_frames(incoming))
        finally:
            self._poller.stop()
            self._poller.join()
            sock.close()

    def _receive(self) -> bytes:
        """The next bytes from the application: blocking, or at light load awake (see
        ``AWAKE_BEFORE``) from just before the one task's expected end."""
        sock = self._sock
        watched = self._watched
        try:  # (the poller's thread changes the set: a copy of one slot, or nothing)
            (slot,) = tuple(watched)
        except (ValueError, RuntimeError):
            return self._recv()
        wait = slot.expected_done - AWAKE_BEFORE - time.monotonic()
        if wait > 0:  # asleep until shortly before the task ends
            readable, _, _ = select.select([sock], [], [], wait)
            if readable:
                return self._recv()
        started = time.monotonic()
        give_up = started + AWAKE_AT_MOST
        while True:
            try:
                return self._recv(socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
            now = time.monotonic()
            delivered = self._delivered_at
            if now > give_up or (not watched and delivered and now > delivered + AWAKE_AFTER):
                return self._recv()

    def _recv(self, flags: int = 0) -> bytes:
        """One read, keeping the descriptors that come with it (frame buffers')."""
        data, fds = receive_with_fds(self._sock, flags)
        self._fds += fds
        return data

    def _stop(self) -> None:
        self._stopped = True

    def _on_messages(self, messages: list[Any]) -> None:
        for message in messages:
            kind = message[0]
            if kind == "submit":
                self._submit(message[1])
            elif kind == "ping":
                self._send(("pong", message[1]))
            elif kind == "inject":
                self._inject(*message[1:])
            elif kind == "control":
                self._control(*message[1:])
            elif kind == "frames":
                self._map_frames(message[1])
            elif kind == "close":
                self._stop()

    def _map_frames(self, frames: list[tuple[int, int]]) -> None:
        """Map the application's frame buffers; their descriptors came with the
        message's first byte, so they are here, in order."""
        fds, self._fds = self._fds[: len(frames)], self._fds[len(frames) :]
        if self._frames is None:  # (host conversion: the application never sends them)
            for fd in fds:
                os.close(fd)
            return
        self._frames.add(frames, fds)

    def _send(self, message: Any) -> None:
        """Send from either thread; a gone peer is seen by the receiving thread."""
        data = frame(message)
        with self._send_lock, contextlib.suppress(OSError):
            self._sock.sendall(data)

    def _submit(self, entries: list[Any]) -> None:
        """Submit each slot: an entry is its number, or (device conversion) its number
        and the reads the application staged for its conversion kernels."""
        cores, poller = self._device, self._poller
        now = time.monotonic()
        for entry in entries:
            number, reads = entry if isinstance(entry, tuple) else (entry, None)
            slot = self._slots[number]
            try:
                if reads is not None:  # (a frame buffer's read fails here if not mapped)
                    cores.path.staged_elsewhere(slot, reads)
                cores.submit(slot, now)
            except Exception as exc:
                if is_sticky(exc) or self._context_poisoned():
                    # cuDLA reports a poisoned context as a status of its own: either
                    # way, nothing more can run in this process.
                    self._context_lost(exc)
                    return
                doing = f"core {slot.core.core}: submitting the request"
                error = device_error(doing, exc) or AiodlaError(f"{doing} failed: {exc!r}")
                self._failed[number] = transportable(error)
                # What reached the stream must run before the slot is reused: its
                # completion (with the error) is sent when the stream gets there.
                if not cores.retire(slot, now):
                    self._send(("done", [(number, 0, self._failed.pop(number), None, False)]))
                    continue
            self._watched.add(slot)
            poller.watch(slot)

    def _stage_times(self, slot: Any) -> tuple[float, float, float] | None:
        """Copy-in, DLA and copy-out seconds of the slot's last task (stage_times=True),
        for the application's statistics; None when the events cannot be read."""
        before_copy, before_task, after_task = slot.timing
        elapsed = self._runtime.elapsed_time
        try:
            return (
                elapsed(before_copy, before_task),
                elapsed(before_task, after_task),
                elapsed(after_task, slot.event),
            )
        except Exception:  # a timing read is never worth failing a request
            return None

    def _context_poisoned(self) -> bool:
        try:
            self._runtime.make_current()
        except Exception as exc:
            return is_sticky(exc)
        return False

    def _deliver(self, finished: list[tuple[Any, int]]) -> None:
        """A poller batch: one message, whatever its size (on the poller's thread; what
        it touches of a core, the accounting, only completions touch)."""
        cores, poller = self._device, self._poller
        now = time.monotonic()
        take = cores.take_compute_failure
        batch = []
        for slot, status in finished:
            number = self._index[id(slot)]
            failure = self._failed.pop(number, None)
            ran = failure is None  # else its submission failed: no task ran
            if ran:
                cores.account(slot, status, now)  # the service-time estimate the poller uses
                computed = None if take is None else take(slot)
                failure = None if computed is None else transportable(computed)
            stages = None if slot.timing is None else self._stage_times(slot)
            batch.append((number, status, failure, stages, ran))
        watched = self._watched
        for slot, _ in finished:
            watched.discard(slot)
        self._delivered_at = now
        self._send(("done", batch))
        poller.consumed()

    def _inject(self, token: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        error: BaseException | None = None
        # The emulated runtime's controls, or the GPU stand-in's under the CUDA runtime.
        controls: dict[str, Callable[..., Any]] = {}
        for standin in loaded_libraries().values():
            if isinstance(standin, _StandinFaults):
                controls.update(fail_next_task=standin.fail_next_task, hang_core=standin.hang_core)
        controls.update(runtime_controls(self._runtime))
        control = controls.get(name)
        if name not in FAULT_INJECTIONS or control is None:
            error = AiodlaError(
                f"the worker's {self._runtime.name} runtime has no control {name!r}"
            )
        else:
            try:
                control(*args, **kwargs)
            except Exception as exc:
                error = transportable(exc)
        self._send(("injected", token, error))

    def _control(
        self,
        token: int | None,
        gate: int | None,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """A test control (``gate`` None: the runtime's; else that gate's). A reply
        (result, error) goes back when ``token`` is not None; an unanswered control
        that fails is logged, since nobody waits for it."""
        result: Any = None
        error: BaseException | None = None
        try:
            result = self._apply_control(gate, name, args, kwargs)
        except Exception as exc:
            error = transportable(exc)
        if token is not None:
            self._send(("controlled", token, result, error))
        elif error is not None:
            logger.warning("aiodla worker: test control %s failed: %s", name, error)

    def _apply_control(
        self, gate: int | None, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if gate is not None:
            if name not in GATE_CONTROLS:
                raise AiodlaError(f"a gate has no control {name!r}")
            target = self._gates.get(gate)
            if target is None:  # a gate of a worker this one replaced: gone with it
                return {"release": None, "held": 0, "released": True}[name]
            value = getattr(target, name)
            return value() if name == "release" else value
        control = runtime_controls(self._runtime).get(name)
        if name not in RUNTIME_CONTROLS or control is None:
            raise AiodlaError(f"the worker's {self._runtime.name} runtime has no control {name!r}")
        if name == "hold":  # args: the core, then the number the application gave the gate
            core, number = args
            self._gates[number] = control(core)
            return None
        return control(*args, **kwargs)

    def _context_lost(self, cause: BaseException) -> None:
        """A sticky error (or the poller failed): say why, and go at once."""
        self._send(("lost", f"the CUDA context was lost: {cause}"))
        logging.shutdown()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(CONTEXT_LOST_EXIT)
