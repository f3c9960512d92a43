"""The seam between the engine and the device: the ``Runtime`` protocol.

The engine never imports ``cuda.bindings`` itself; it drives cuDLA and CUDA only
through the calls below. Two implementations exist: the emulated runtime (pure Python
and numpy) and the CUDA runtime (``cuda.bindings.cudla`` + ``cuda.bindings.runtime``).

:class:`Runtime` is what every runtime does. What only some do is a capability, a
protocol a runtime declares in its ``capabilities`` and the engine asks for once, at
open (:func:`offers`): :class:`GraphCapture` (a stream's work captured once and
replayed), :class:`Kernels` (conversion and pre-processing on the stream, device
arrays), :class:`HostRegistration` (page-locking memory the caller allocated:
``isolation="process"``), :class:`ComputeFunctions` (outputs computed by a function of
the user's), :class:`DetectsOnStream` (a ``Detect`` on the slot's stream); and for
tests, :class:`FaultControls` and :class:`WorkerControls`. A capability declared is
whole, or the open fails naming the method it lacks (:func:`check_capabilities`). An
engine opens on a runtime with none of them: it converts on the host and enqueues each
call.

Conventions every runtime follows:

- Handles (devices, modules, registrations, streams, events, device pointers) are
  plain ``int``. Host buffers are :class:`HostBuffer` (pointer + numpy view).
- A failing cuDLA call raises ``cuda.bindings.cudla.CudlaError`` (or a subclass) whose
  ``status`` is the ``cudlaStatus``. ``get_last_error`` returns the status instead.
- A failing CUDA call raises :class:`CudaCallError`; ``sticky`` says the CUDA context
  is poisoned (the process must restart). ``query_event`` returns ``False`` while the
  work is not done ("not ready" is a state, not an error).
- Every call may be made from any thread; ``make_current`` must be called once on a
  thread before that thread's first CUDA call (the poller does so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from cuda.bindings import cudla

from .._descriptors import TensorDescriptor
from .._errors import ConfigurationError

if TYPE_CHECKING:
    from .._detect import DetectPlan
    from .._frame_plan import Geometry, Preprocessing
    from .._tensors import TensorSpec
    from ._detect_output import OutputLayout

__all__ = [
    "CAPABILITIES",
    "CUDA_ERROR_NAMES",
    "STICKY_CUDA_ERRORS",
    "ComputeFunctions",
    "CudaCallError",
    "CudlaError",
    "DetectProgramLike",
    "DetectsOnStream",
    "FaultControls",
    "GraphCapture",
    "HostBuffer",
    "HostRegistration",
    "Kernels",
    "Runtime",
    "TransferCounts",
    "WorkerControls",
    "capability_methods",
    "check_capabilities",
    "cudla_status",
    "offers",
]

# cudaError_t values the engine reasons about (from CUDA's driver_types.h).
CUDA_ERROR_NAMES = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    35: "cudaErrorInsufficientDriver",
    100: "cudaErrorNoDevice",
    214: "cudaErrorECCUncorrectable",
    400: "cudaErrorInvalidResourceHandle",
    600: "cudaErrorNotReady",
    700: "cudaErrorIllegalAddress",
    702: "cudaErrorLaunchTimeout",
    714: "cudaErrorHardwareStackError",
    715: "cudaErrorIllegalInstruction",
    716: "cudaErrorMisalignedAddress",
    717: "cudaErrorInvalidAddressSpace",
    718: "cudaErrorInvalidPc",
    719: "cudaErrorLaunchFailure",
    911: "cudaErrorExternalDevice",
    999: "cudaErrorUnknown",
}
# Errors after which every CUDA call in the process fails (the context is lost).
STICKY_CUDA_ERRORS = frozenset({214, 700, 702, 714, 715, 716, 717, 718, 719, 911})


# What a failing cuDLA call raises (the runtimes raise it or a subclass). Re-exported so
# the engine can catch it without importing cuda.bindings itself.
CudlaError: type[Exception] = cudla.CudlaError


def cudla_status(error: BaseException) -> int | None:
    """The cudlaStatus a cuDLA failure carries, or None for any other exception."""
    if not isinstance(error, CudlaError):
        return None
    status = getattr(error, "status", None)
    if status is None and error.args and isinstance(error.args[0], int):
        status = error.args[0]  # bindings whose CudlaError keeps the code only in args
    return None if status is None else int(status)


class CudaCallError(Exception):
    """A CUDA runtime call failed; ``code`` is the ``cudaError_t`` value, ``detail``
    what the runtime knows beyond the code (e.g. how many bytes were asked for)."""

    def __init__(
        self, call: str, code: int, name: str | None = None, detail: str | None = None
    ) -> None:
        self.call = call
        self.code = int(code)
        self.name = name or CUDA_ERROR_NAMES.get(self.code, f"cudaError {self.code}")
        self.detail = detail
        super().__init__(
            f"{call} failed: {self.name} ({self.code})" + (f": {detail}" if detail else "")
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Rebuilt from its fields (not from the message): it crosses into and out of
        # the worker process of isolation="process".
        return type(self), (self.call, self.code, self.name, self.detail)

    @property
    def sticky(self) -> bool:
        """True when the error poisoned the CUDA context for the whole process."""
        return self.code in STICKY_CUDA_ERRORS


@dataclasses.dataclass(frozen=True, eq=False)
class HostBuffer:
    """Pinned (page-locked) host memory: its address and a writable uint8 view.

    ``device_ptr`` is where kernels read and write it in place when it was allocated
    ``mapped`` (zero-copy; on an integrated GPU such as a Jetson's, the same DRAM);
    0 when it is not mapped.
    """

    ptr: int
    array: np.ndarray[Any, np.dtype[np.uint8]]
    device_ptr: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclasses.dataclass
class TransferCounts:
    """What a runtime has copied, allocated and converted since it was made.

    Tests assert on these: no host round trip for a device array (no copy counted),
    no allocation on the request path (``allocations`` unchanged while serving).
    """

    copies_to_device: int = 0
    bytes_to_device: int = 0
    copies_to_host: int = 0
    bytes_to_host: int = 0
    allocations: int = 0  # malloc and host_alloc
    pool_allocations: int = 0  # stream-ordered allocations (device outputs)
    conversions: int = 0  # pack and unpack kernels enqueued


@runtime_checkable
class Runtime(Protocol):
    """What every runtime does: cuDLA (hybrid mode) and the CUDA calls around it."""

    name: str
    capabilities: frozenset[type]
    """The capabilities below that the runtime offers, declared: each one whole (see
    :func:`check_capabilities`); one it does not declare is not used."""
    poll_pause: float
    """Seconds the poller pauses between sweeps while work is in flight (0: none)."""
    counts: TransferCounts
    device: int
    """The CUDA device ordinal the runtime works on."""
    has_device_memory: bool
    """False when "device memory" is host memory (the emulated runtime): device outputs
    are host-backed there."""

    # -- discovery ---------------------------------------------------------------------
    def version(self) -> int:
        """cuDLA version as ``1000000 * major + 1000 * minor + patch``."""
        ...

    def device_count(self) -> int:
        """How many DLA cores this runtime can drive."""
        ...

    def make_current(self) -> None:
        """Make the CUDA device current on the calling thread."""
        ...

    def stated_service_time(self, loadable: bytes) -> float | None:
        """Seconds one task of ``loadable`` occupies one core, when the loadable states
        it (an emulator loadable does); None when it must be learned (a DLA loadable)."""
        ...

    # -- cuDLA ---------------------------------------------------------------------------
    def create_device(self, core: int) -> int: ...
    def destroy_device(self, device: int) -> None: ...
    def load_module(self, device: int, loadable: bytes) -> int: ...
    def unload_module(self, module: int) -> None: ...
    def module_tensors(
        self, module: int
    ) -> tuple[Sequence[TensorDescriptor], Sequence[TensorDescriptor]]:
        """The module's input and output tensor descriptors, in order."""
        ...

    def mem_register(self, device: int, ptr: int, nbytes: int) -> int:
        """Register device memory with the DLA; returns the pointer tasks must use."""
        ...

    def mem_unregister(self, device: int, registered: int) -> None: ...
    def make_task(self, module: int, inputs: Sequence[int], outputs: Sequence[int]) -> Any:
        """Build a reusable task from registered pointers (opaque to the engine)."""
        ...

    def submit_task(self, device: int, task: Any, stream: int) -> None:
        """Enqueue the task on ``stream`` (hybrid mode: no wait or signal events)."""
        ...

    def get_last_error(self, device: int) -> int:
        """The status of the device's failed task since the last call, 0 when none."""
        ...

    def set_task_timeout(self, device: int, milliseconds: int) -> None: ...

    # -- CUDA ----------------------------------------------------------------------------
    def create_stream(self) -> int: ...
    def destroy_stream(self, stream: int) -> None: ...
    def create_event(self, timing: bool = False) -> int:
        """An event for the poller; ``timing=True`` makes one ``elapsed_time`` can read."""
        ...

    def elapsed_time(self, start: int, end: int) -> float:
        """Seconds between two completed timing events."""
        ...

    def destroy_event(self, event: int) -> None: ...
    def record_event(self, event: int, stream: int) -> None: ...
    def query_event(self, event: int) -> bool:
        """True when all work before the event's last record is done."""
        ...

    def malloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def host_alloc(self, nbytes: int, mapped: bool = False) -> HostBuffer: ...
    def host_free(self, buffer: HostBuffer) -> None: ...
    def copy_to_device(self, dst: int, src: HostBuffer, nbytes: int, stream: int) -> None: ...
    def copy_to_host(self, dst: HostBuffer, src: int, nbytes: int, stream: int) -> None: ...
    def close(self) -> None:
        """Release what the runtime itself holds (threads, libraries); idempotent."""
        ...


@runtime_checkable
class GraphCapture(Runtime, Protocol):
    """A runtime that captures a stream's work once and replays it whole (CUDA graphs);
    without it the engine enqueues each call."""

    def begin_capture(self, stream: int) -> None:
        """From now on, work this thread enqueues on ``stream`` (copies, conversions,
        event records) is recorded, not run, until :meth:`end_capture`. Raises when
        the runtime cannot capture (the engine then enqueues each call instead)."""
        ...

    def end_capture(self, stream: int) -> Any:
        """Stop recording ``stream``; the recorded work as a graph that
        :meth:`launch_graph` enqueues, whole, any number of times (a CUDA graph)."""
        ...

    def launch_graph(self, graph: Any, stream: int) -> None:
        """Enqueue a captured graph's work on ``stream``, as its calls would have."""
        ...

    def destroy_graph(self, graph: Any) -> None: ...


@runtime_checkable
class Kernels(Runtime, Protocol):
    """A runtime with GPU kernels on the stream: layout conversion, camera-frame
    pre-processing, and device arrays in and out (``Engine(convert="device")``);
    without it the engine converts on the host."""

    def is_integrated(self) -> bool:
        """True when the GPU shares the host's memory (a Jetson): mapped pinned buffers
        are read in place, with no copy."""
        ...

    def pointer_device(self, ptr: int) -> int:
        """The CUDA device ordinal that owns device address ``ptr``."""
        ...

    def wait_event(self, stream: int, event: int) -> None:
        """Work enqueued on ``stream`` from now on waits for the event's last record."""
        ...

    def malloc_async(self, nbytes: int, stream: int) -> int:
        """Device memory from the stream-ordered pool, usable in order on ``stream``."""
        ...

    def free_async(self, ptr: int) -> None:
        """Give :meth:`malloc_async` memory back to the pool (any thread)."""
        ...

    def read_device(self, src: int, out: np.ndarray[Any, Any]) -> None:
        """Copy ``out.nbytes`` bytes at ``src`` into the contiguous ``out``, now
        (blocking: ``DeviceTensor.to_host``)."""
        ...

    def prepare_conversions(
        self,
        packs: Sequence[tuple[TensorSpec, np.dtype[Any]]],
        unpacks: Sequence[tuple[TensorSpec, np.dtype[Any]]],
    ) -> None:
        """Make ready the conversions :meth:`pack` and :meth:`unpack` will be asked for
        (the CUDA runtime compiles its kernels); raises ``RuntimeUnavailableError``
        when it cannot."""
        ...

    def pack(
        self,
        spec: TensorSpec,
        source: np.dtype[Any],
        src: int,
        src_strides: tuple[int, int, int, int],
        dst: int,
        stream: int,
    ) -> None:
        """Enqueue on ``stream``: the logical (n, c, h, w) array of ``source`` values at
        device address ``src`` (strides in elements) into ``spec``'s DLA layout at
        ``dst``, every byte of it, as ``spec.pack`` would."""
        ...

    def unpack(
        self, spec: TensorSpec, result: np.dtype[Any], src: int, dst: int, stream: int
    ) -> None:
        """Enqueue on ``stream``: the DLA buffer at ``src`` into a dense logical array
        of ``result`` at ``dst``, as ``spec.unpack(..., dtype=result)`` would."""
        ...

    def prepare_preprocess(self, targets: Sequence[tuple[TensorSpec, Preprocessing]]) -> None:
        """Make ready the camera-frame pre-processing of these inputs (the CUDA runtime
        compiles one fused kernel each); raises ``RuntimeUnavailableError`` when it cannot."""
        ...

    def preprocess(
        self,
        spec: TensorSpec,
        frame: int,
        height: int,
        width: int,
        pitch: int,
        dst: int,
        stream: int,
    ) -> None:
        """Enqueue on ``stream``: the uint8 frame at device address ``frame`` (an image of
        ``height`` x ``width``, rows ``pitch`` bytes apart; nv12's UV rows follow) into
        ``spec``'s DLA layout at ``dst``, as ``spec.pack(pre.apply(frame, spec))``."""
        ...


@runtime_checkable
class HostRegistration(Runtime, Protocol):
    """A runtime that page-locks memory the caller allocated: the staging that
    ``isolation="process"`` shares between two processes."""

    def host_register(
        self, array: np.ndarray[Any, np.dtype[np.uint8]], mapped: bool = False
    ) -> HostBuffer:
        """Page-lock ``array`` (``cudaHostRegister``; ``mapped``: with a device address
        as well); released with ``host_free``, which leaves the memory to its owner."""
        ...


@runtime_checkable
class ComputeFunctions(Runtime, Protocol):
    """A runtime that may compute a module's outputs with a function of the user's
    (the emulated runtime's ``compute=``): such a task can fail apart from the DLA."""

    def module_computes(self, module: int) -> bool:
        """True when the runtime computes ``module``'s outputs with a function of the
        user's (the emulated runtime's ``compute=``); such a task can fail apart from
        the DLA, and :meth:`take_compute_failure` says so."""
        ...

    def take_compute_failure(self, stream: int) -> BaseException | None:
        """The error of the last task completed on ``stream`` if its compute function
        failed, else None; reading it clears it."""
        ...


@runtime_checkable
class FaultControls(Protocol):
    """The emulated runtime's test controls (``aiodla.testing`` reaches them, in the
    worker process too): fault injection, gates, and the counters tests read."""

    def fail_next_task(self, core: int, status: int = ..., *, on_stream: bool = ...) -> None: ...
    def hang_core(self, core: int, hung: bool = True) -> None: ...
    def poison(self, code: int = ...) -> None: ...
    def fail_call(
        self, call: str, error: BaseException | int, *, after: int = 0, core: int | None = None
    ) -> None: ...
    def hold(self, core: int) -> Any: ...
    def core_tasks(self, core: int) -> int: ...
    def core_busy_time(self, core: int) -> float: ...
    def live_handles(self) -> dict[str, int]: ...
    def bind_compute(self, loadable: bytes, compute: Any) -> None: ...


@runtime_checkable
class WorkerControls(Protocol):
    """A runtime whose test controls follow an engine into its worker process
    (``isolation="process"``; ``aiodla.testing``'s): the worker runs an emulated runtime
    of its own, armed with ``worker_setup``'s calls before it opens the model, and the
    controls reach it through the supervisor they are attached to."""

    def worker_setup(self, loadable: bytes) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
        """The controls armed here that the worker applies before it opens."""
        ...

    def attach_worker(self, supervisor: Any, loadable: bytes) -> Callable[[], None]:
        """Reach the worker of a process-mode engine; returns how to let it go."""
        ...


@runtime_checkable
class DetectProgramLike(Protocol):
    """What a runtime's prepared detector tells the engine: the buffers a slot needs."""

    layout: OutputLayout

    @property
    def work_bytes(self) -> int: ...
    @property
    def out_bytes(self) -> int: ...


@runtime_checkable
class DetectsOnStream(Protocol):
    """A runtime that runs a matched :class:`~aiodla.Detect` on a stream (checked once,
    at open)."""

    def prepare_detect(self, plan: DetectPlan) -> DetectProgramLike:
        """Make the post-processing of ``plan`` ready (the CUDA runtime compiles its
        kernels now); RuntimeUnavailableError when it cannot."""
        ...

    def detect(
        self,
        program: Any,
        heads: Sequence[int],
        work: int,
        out: int,
        stream: int,
        geometry: Geometry | None = None,
        frame_size: tuple[int, int] | None = None,
    ) -> None:
        """Enqueue on ``stream``: the heads' DLA buffers (device pointers, in the plan's
        order) into the output buffer at ``out`` (:mod:`aiodla.runtime._detect_output`),
        ``work`` as scratch; mapped into a frame of ``frame_size`` when given."""
        ...


# The capabilities the engine uses, each asked once, at open, with :func:`offers`. (The
# test controls, FaultControls and WorkerControls, are asked with isinstance by the
# testing code and the worker process that serve them.)
CAPABILITIES: tuple[type, ...] = (
    GraphCapture,
    Kernels,
    HostRegistration,
    ComputeFunctions,
    DetectsOnStream,
)


def capability_methods(capability: type) -> frozenset[str]:
    """The methods ``capability`` adds to the :class:`Runtime` protocol."""
    own: set[str] = set()
    for protocol in capability.__mro__:
        if protocol in (Runtime, Protocol, object) or protocol.__name__ == "Generic":
            continue
        own.update(
            name for name, value in vars(protocol).items() if callable(value) and name[0] != "_"
        )
    return frozenset(own)


def check_capabilities(runtime: Runtime) -> None:
    """Refuse a runtime that declares a capability without each of its methods (at open:
    a capability half there would fail on the request path, or, asked by ``isinstance``,
    be silently left unused)."""
    present = set(dir(runtime))
    for capability in runtime.capabilities:
        if capability not in CAPABILITIES:
            raise ConfigurationError(
                f"the {runtime.name} runtime declares {capability!r}, which is not a "
                f"capability (they are {[c.__name__ for c in CAPABILITIES]})"
            )
        missing = sorted(capability_methods(capability) - present)
        if missing:
            raise ConfigurationError(
                f"the {runtime.name} runtime declares {capability.__name__} but has no "
                f"{', '.join(missing)}"
            )


def offers(runtime: Runtime, capability: Any) -> Any:
    """``runtime`` as ``capability`` when it declares it, else None (the caller types
    what it gets: ``kernels: Kernels | None = offers(runtime, Kernels)``; a protocol is
    not a concrete class that a signature could name)."""
    return runtime if capability in runtime.capabilities else None
