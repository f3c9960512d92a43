"""The CUDA runtime: cuDLA hybrid mode through ``cuda.bindings.cudla`` and ``.runtime``.

It drives the real ``libcudla.so.1`` on a Jetson, or aiodla's GPU stand-in on any
NVIDIA GPU, in the order of NVIDIA's cuDLAHybridMode sample: make the CUDA device
current, create the DLA device in ``CUDA_DLA`` mode, load the loadable, read its tensor
descriptors, ``cudaMalloc`` and register the buffers, build one ``cudla.Task`` per slot,
and submit it into a CUDA stream between the slot's copies.

Conventions (see ``_protocol``): handles are plain ints. cuDLA failures raise
``cudla.CudlaError`` with ``.status``; a status outside ``cudla.Status`` (which the
bindings cannot even turn into a ``CudlaError``: they raise ``ValueError``) becomes
:class:`UnknownCudlaStatusError`, still a ``CudlaError``. CUDA failures raise
:class:`CudaCallError` naming the call and the error; ``cudaErrorNotReady`` from an
event query is "not done yet", not an error.

Within the package, this module and the stand-in's build are the only places that
touch ``cuda.bindings.runtime``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from cuda.bindings import cudla
from cuda.bindings import runtime as _bindings_runtime
from cuda.bindings import runtime as _rt

from .._descriptors import TensorDescriptor
from .._errors import RuntimeUnavailableError
from . import _gil_held
from ._cuda_errors import check_cuda, cuda_error, error_name
from ._cuda_graphs import CudaGraph, CudaGraphs
from ._cuda_host import PinnedMemory
from ._protocol import (
    ComputeFunctions,
    CudaCallError,
    DetectsOnStream,
    GraphCapture,
    HostBuffer,
    HostRegistration,
    Kernels,
    TransferCounts,
)

if TYPE_CHECKING:
    from .._detect import DetectPlan
    from .._frame_plan import Geometry, Preprocessing
    from .._tensors import TensorSpec
    from ._conversion_kernels import ConversionKernels
    from ._detect_kernels import DetectKernels
    from ._preprocess_kernels import PreprocessKernels

__all__ = [
    "NO_LIBCUDLA",
    "CudaRuntime",
    "InvalidCudlaArgumentError",
    "UnknownCudlaStatusError",
    "check_cuda",
    "cuda_error",
    "cudla_failure",
    "probe",
]

_T = TypeVar("_T")

_SUCCESS = 0
_NOT_READY = 600
_SETTLED = (_SUCCESS, _NOT_READY)
_INVALID_VALUE = 1
_LEGACY_STREAM = 1  # cudaStreamLegacy
_MEMORY_DEVICE, _MEMORY_MANAGED = 2, 3  # cudaMemoryType
_INVALID_PARAM = 1  # cudlaErrorInvalidParam
_UINT32_MAX = 0xFFFFFFFF
_NOT_A_STATUS = re.compile(r"^\s*(-?\d+) is not a valid")

NO_LIBCUDLA = "no cuDLA runtime (libcudla.so.1) was found"


class UnknownCudlaStatusError(cudla.CudlaError):  # type: ignore[misc]
    """A cuDLA call returned a status that ``cudla.Status`` does not define."""

    def __init__(self, status: int, call: str) -> None:
        # CudlaError.__init__ looks the status up in cudla.Status and would raise
        # ValueError, so set what it sets without calling it.
        Exception.__init__(self, f"{call} failed with cudlaStatus {status} (not in cudla.Status)")
        self.status = int(status)
        self.call = call

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, self.call))


class InvalidCudlaArgumentError(cudla.CudlaError):  # type: ignore[misc]
    """A value the C signature cannot carry (e.g. a timeout beyond uint32): InvalidParam."""

    def __init__(self, call: str, detail: str) -> None:
        super().__init__(int(cudla.Status(_INVALID_PARAM)))
        self.call = call
        self.detail = detail

    def __str__(self) -> str:
        return f"{super().__str__()}: {self.call}: {self.detail}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.detail))


def _cudla_call(call: str, function: Callable[..., _T], *args: Any) -> _T:
    """Call a ``cuda.bindings.cudla`` function; a status outside ``cudla.Status`` surfaces
    from the bindings as ``ValueError``, which becomes :class:`UnknownCudlaStatusError`."""
    try:
        return function(*args)
    except cudla.CudlaError:
        raise
    except ValueError as exc:
        match = _NOT_A_STATUS.match(str(exc))
        if match is None:
            raise
        raise UnknownCudlaStatusError(int(match.group(1)), call) from None


def cudla_failure(call: str, status: int) -> cudla.CudlaError:
    """What the bindings raise for a failing ``status`` of ``call``."""
    try:
        return cudla.CudlaError(status)
    except ValueError:  # not in cudla.Status
        return UnknownCudlaStatusError(status, call)


def _bindings() -> Any:
    """The bindings this module calls (which the GPU tests' host fake replaces here)."""
    return _rt


def probe() -> tuple[bool, str]:
    """Can this machine's cuDLA drive at least one DLA core? ``(usable, reason)``.

    Never raises: the reason says, for a person, what is missing ("no cuDLA runtime
    (libcudla.so.1) was found", no CUDA device, ...) or what was found.
    """
    try:
        try:
            cores = int(_cudla_call("cudlaDeviceGetCount", cudla.device_get_count))
        except Exception as exc:
            if _is_not_found(exc):
                return False, NO_LIBCUDLA
            return False, f"libcudla.so.1 could not be used: {exc}"
        if cores < 1:
            return False, "libcudla.so.1 reports no DLA cores"
        error, devices = _rt.cudaGetDeviceCount()[:2]
        if error != _SUCCESS:
            return False, f"cuDLA hybrid mode needs a CUDA device: {error_name(error)}"
        if devices < 1:
            return False, "cuDLA hybrid mode needs a CUDA device, and none was found"
        return True, f"libcudla.so.1 reports {cores} DLA core{'s' if cores != 1 else ''}"
    except Exception as exc:  # never raise: "auto" must always get an answer
        return False, f"probing cuDLA failed: {type(exc).__name__}: {exc}"


def _is_not_found(exc: BaseException) -> bool:
    try:
        from cuda.pathfinder import DynamicLibNotFoundError
    except ImportError:  # an older pathfinder: recognise it by name
        return type(exc).__name__ == "DynamicLibNotFoundError"
    return isinstance(exc, DynamicLibNotFoundError)


class CudaRuntime:
    """cuDLA hybrid mode and the CUDA calls aiodla needs, on CUDA device ``device``.

    Creating it calls nothing; :meth:`make_current` (called by the engine on each of its
    threads) sets the device: cuDLA works in the calling thread's CUDA context. With
    ``hold_gil`` (the default) a request's short calls keep the GIL (see ``_gil_held``);
    ``hold_gil=False`` makes the loop's and the poller's calls through ``cuda.bindings``,
    which release it. ``states`` reads the service time a loadable states (none for a
    DLA loadable; runtime selection passes the emulator format's, for the GPU stand-in:
    this module knows no emulator format)."""

    name = "cuda"
    # Every capability the engine uses, declared: each is checked whole at open.
    capabilities: frozenset[type] = frozenset(
        {GraphCapture, Kernels, HostRegistration, ComputeFunctions, DetectsOnStream}
    )
    # A CUDA event query costs a microsecond or two: the poller need not pause.
    poll_pause = 0.0
    has_device_memory = True
    # Graph capture and launch: its collaborator's methods (see _cuda_graphs), bound
    # here so that a launch costs no call of this class's on the request path.
    begin_capture: Callable[[int], None]
    end_capture: Callable[[int], CudaGraph]
    launch_graph: Callable[[CudaGraph, int], None]
    destroy_graph: Callable[[CudaGraph], None]
    # Pinned host memory: allocated, or the caller's page-locked (see _cuda_host).
    host_alloc: Callable[..., HostBuffer]
    host_register: Callable[..., HostBuffer]
    host_free: Callable[[HostBuffer], None]

    def __init__(
        self,
        device: int = 0,
        *,
        hold_gil: bool = True,
        states: Callable[[bytes], float | None] = lambda loadable: None,
    ) -> None:
        if not isinstance(device, int) or isinstance(device, bool) or device < 0:
            from .._errors import ConfigurationError

            raise ConfigurationError(f"{device=} must be a CUDA device index >= 0")
        self.device = device
        # What service time a loadable states: a DLA loadable none (it is learned); over
        # the GPU stand-in, runtime selection passes the emulator format's reader.
        self._states = states
        # Whether the hot path's calls keep the GIL (_gil_held), found at create_device.
        self.hold_gil = hold_gil
        self._held = _gil_held.EntryPoints()
        self._closed = False
        self._integrated: bool | None = None
        # Compiled kernels by id of the tensor's spec, the spec kept alive beside them:
        # engines sharing this runtime each add theirs, and the lookup per request skips
        # hashing a dataclass (microseconds).
        self._kernels: dict[int, tuple[TensorSpec, ConversionKernels]] = {}
        self._preprocess: dict[int, tuple[TensorSpec, PreprocessKernels]] = {}
        self.counts = TransferCounts()
        graphs = self._graphs = CudaGraphs(self.counts, self._held, _bindings)
        self.begin_capture, self.end_capture = graphs.begin_capture, graphs.end_capture
        self.launch_graph, self.destroy_graph = graphs.launch_graph, graphs.destroy_graph
        self._capturing = graphs.capturing
        pinned = PinnedMemory(self.counts, _bindings)
        self.host_alloc, self.host_register = pinned.host_alloc, pinned.host_register
        self.host_free = pinned.host_free

    def __repr__(self) -> str:
        return f"<CudaRuntime device={self.device}>"

    # -- discovery ---------------------------------------------------------------------

    def version(self) -> int:
        return int(_cudla_call("cudlaGetVersion", cudla.get_version))

    def device_count(self) -> int:
        return int(_cudla_call("cudlaDeviceGetCount", cudla.device_get_count))

    def module_computes(self, module: int) -> bool:
        return False  # cuDLA runs the loadable itself

    def take_compute_failure(self, stream: int) -> BaseException | None:
        return None

    def stated_service_time(self, loadable: bytes) -> float | None:
        return self._states(loadable)

    def make_current(self) -> None:
        check_cuda("cudaSetDevice", _rt.cudaSetDevice(self.device))

    # -- cuDLA -------------------------------------------------------------------------

    def create_device(self, core: int) -> int:
        # Hybrid mode binds the DLA handle to the CUDA context current now.
        self.make_current()
        handle = int(
            _cudla_call("cudlaCreateDevice", cudla.create_device, core, int(cudla.Mode.CUDA_DLA))
        )
        if self.hold_gil and not any(self._held):
            # The driver's only over the real bindings (a test fake's handles are not its).
            self.use_entry_points(_gil_held.entry_points(driver=_rt is _bindings_runtime))
        return handle

    def use_entry_points(self, held: _gil_held.EntryPoints) -> None:
        """Make the hot path's calls through ``held`` (the runtime's and its graphs')."""
        # The graphs keep their own reference: a launch reads it without a hop through
        # the runtime, so both must change together.
        self._held = self._graphs.held = held

    def destroy_device(self, device: int) -> None:
        _cudla_call("cudlaDestroyDevice", cudla.destroy_device, device)

    def load_module(self, device: int, loadable: bytes) -> int:
        blob = bytes(loadable)
        load = cudla.module_load_from_memory
        return int(_cudla_call("cudlaModuleLoadFromMemory", load, device, blob, len(blob), 0))

    def unload_module(self, module: int) -> None:
        _cudla_call("cudlaModuleUnload", cudla.module_unload, module, 0)

    def module_tensors(
        self, module: int
    ) -> tuple[Sequence[TensorDescriptor], Sequence[TensorDescriptor]]:
        kinds = cudla.ModuleAttributeType
        result = []
        for attribute in (kinds.INPUT_TENSOR_DESCRIPTORS, kinds.OUTPUT_TENSOR_DESCRIPTORS):
            # The bindings query the count, size the array and copy each record out.
            records = _cudla_call(
                "cudlaModuleGetAttributes", cudla.module_get_attributes, module, int(attribute)
            )
            result.append(tuple(TensorDescriptor.from_cudla(record) for record in records))
        return result[0], result[1]

    def mem_register(self, device: int, ptr: int, nbytes: int) -> int:
        return int(_cudla_call("cudlaMemRegister", cudla.mem_register, device, ptr, nbytes, 0))

    def mem_unregister(self, device: int, registered: int) -> None:
        _cudla_call("cudlaMemUnregister", cudla.mem_unregister, device, registered)

    def make_task(self, module: int, inputs: Sequence[int], outputs: Sequence[int]) -> Any:
        for pointer in (*inputs, *outputs):
            if type(pointer) is not int:
                raise TypeError(
                    f"tensor pointers must be Python ints, got {type(pointer).__name__}"
                )
        task = cudla.Task()
        task.module_handle = module
        # The Task keeps these pointer arrays alive for as long as it lives.
        task.input_tensor = list(inputs)
        task.output_tensor = list(outputs)
        task.wait_events = 0
        task.signal_events = 0
        return task

    def submit_task(self, device: int, task: Any, stream: int) -> None:
        # task.ptr: the cudlaTask's address; every bindings release takes it as an int.
        held = self._held.submit_task
        if held is None:
            _cudla_call("cudlaSubmitTask", cudla.submit_task, device, task.ptr, 1, stream, 0)
        elif status := held(device, task.ptr, 1, stream, 0):
            raise cudla_failure("cudlaSubmitTask", status)

    def get_last_error(self, device: int) -> int:
        held = self._held.last_error
        return int(cudla.get_last_error(device)) if held is None else held(device)

    def set_task_timeout(self, device: int, milliseconds: int) -> None:
        if not 0 <= milliseconds <= _UINT32_MAX:
            raise InvalidCudlaArgumentError(
                "cudlaSetTaskTimeoutInMs", f"{milliseconds} ms does not fit in 32 bits"
            )
        _cudla_call("cudlaSetTaskTimeoutInMs", cudla.set_task_timeout_in_ms, device, milliseconds)

    # -- CUDA --------------------------------------------------------------------------

    def create_stream(self) -> int:
        stream = check_cuda(
            "cudaStreamCreateWithFlags", _rt.cudaStreamCreateWithFlags(_rt.cudaStreamNonBlocking)
        )
        return int(stream)

    def destroy_stream(self, stream: int) -> None:
        check_cuda("cudaStreamDestroy", _rt.cudaStreamDestroy(stream))

    def synchronize_stream(self, stream: int) -> None:
        check_cuda("cudaStreamSynchronize", _rt.cudaStreamSynchronize(stream))

    def create_event(self, timing: bool = False) -> int:
        # The poller's events skip timing: cheaper to record and to query.
        flags = _rt.cudaEventDefault if timing else _rt.cudaEventDisableTiming
        event = check_cuda("cudaEventCreateWithFlags", _rt.cudaEventCreateWithFlags(flags))
        return int(event)

    def elapsed_time(self, start: int, end: int) -> float:
        milliseconds = check_cuda("cudaEventElapsedTime", _rt.cudaEventElapsedTime(start, end))
        return float(milliseconds) / 1000.0

    def destroy_event(self, event: int) -> None:
        check_cuda("cudaEventDestroy", _rt.cudaEventDestroy(event))

    def record_event(self, event: int, stream: int) -> None:
        if not self._capturing or not self._graphs.record_captured(event, stream):
            check_cuda("cudaEventRecord", _rt.cudaEventRecord(event, stream))

    def query_event(self, event: int) -> bool:
        held = self._held.event_query
        error = _rt.cudaEventQuery(event)[0] if held is None else held(event)
        if held is not None and error not in _SETTLED:  # asked again: the bindings name it
            error = _rt.cudaEventQuery(event)[0]
        if error == _SUCCESS:
            return True
        if error == _NOT_READY:
            return False
        raise cuda_error("cudaEventQuery", error)

    def malloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            # cudaMalloc(0) "succeeds" with a null pointer; no caller means that.
            raise CudaCallError("cudaMalloc", _INVALID_VALUE)
        pointer = int(check_cuda("cudaMalloc", _rt.cudaMalloc(nbytes)))
        self.counts.allocations += 1
        return pointer

    def free(self, ptr: int) -> None:
        check_cuda("cudaFree", _rt.cudaFree(ptr))

    def copy_to_device(self, dst: int, src: HostBuffer, nbytes: int, stream: int) -> None:
        if not 0 < nbytes <= src.nbytes:
            raise CudaCallError("cudaMemcpyAsync", _INVALID_VALUE)
        self.counts.copies_to_device += 1
        self.counts.bytes_to_device += nbytes
        check_cuda(
            "cudaMemcpyAsync",
            _rt.cudaMemcpyAsync(
                dst, src.ptr, nbytes, _rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream
            ),
        )

    def copy_to_host(self, dst: HostBuffer, src: int, nbytes: int, stream: int) -> None:
        if not 0 < nbytes <= dst.nbytes:
            raise CudaCallError("cudaMemcpyAsync", _INVALID_VALUE)
        self.counts.copies_to_host += 1
        self.counts.bytes_to_host += nbytes
        check_cuda(
            "cudaMemcpyAsync",
            _rt.cudaMemcpyAsync(
                dst.ptr, src, nbytes, _rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream
            ),
        )

    @contextlib.contextmanager
    def _on_this_device(self) -> Iterator[None]:
        """This runtime's device current for a call made on a thread of the user's (a
        DeviceTensor dropped or copied there), and that thread's own device again after."""
        previous = int(check_cuda("cudaGetDevice", _rt.cudaGetDevice()))
        if previous == self.device:
            yield
            return
        self.make_current()
        try:
            yield
        finally:
            _rt.cudaSetDevice(previous)

    def read_device(self, src: int, out: np.ndarray[Any, Any]) -> None:
        if not out.flags.c_contiguous:
            raise CudaCallError("cudaMemcpy", _INVALID_VALUE)
        with self._on_this_device():
            check_cuda(
                "cudaMemcpy",
                _rt.cudaMemcpy(
                    out.ctypes.data, src, out.nbytes, _rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
                ),
            )

    def malloc_async(self, nbytes: int, stream: int) -> int:
        if nbytes <= 0:
            raise CudaCallError("cudaMallocAsync", _INVALID_VALUE)
        # The device's default memory pool: freed memory is reused, no cudaMalloc.
        pointer = int(check_cuda("cudaMallocAsync", _rt.cudaMallocAsync(nbytes, stream)))
        self.counts.pool_allocations += 1
        return pointer

    def free_async(self, ptr: int) -> None:
        # Called when a device output is dropped, from whatever thread dropped it. On the
        # legacy default stream: after any work the consumer queued there (torch's and
        # CuPy's default stream); the engine's own work on it finished before it was
        # handed out.
        with self._on_this_device():
            check_cuda("cudaFreeAsync", _rt.cudaFreeAsync(ptr, _LEGACY_STREAM))

    def is_integrated(self) -> bool:
        if self._integrated is None:
            attribute = _rt.cudaDeviceAttr.cudaDevAttrIntegrated
            value = check_cuda(
                "cudaDeviceGetAttribute", _rt.cudaDeviceGetAttribute(attribute, self.device)
            )
            self._integrated = bool(value)
        return self._integrated

    def pointer_device(self, ptr: int) -> int:
        attributes = check_cuda("cudaPointerGetAttributes", _rt.cudaPointerGetAttributes(ptr))
        kind = int(attributes.type)
        if kind not in (_MEMORY_DEVICE, _MEMORY_MANAGED):  # host or unregistered memory
            raise CudaCallError("cudaPointerGetAttributes", _INVALID_VALUE)
        return int(attributes.device)

    def wait_event(self, stream: int, event: int) -> None:
        check_cuda("cudaStreamWaitEvent", _rt.cudaStreamWaitEvent(stream, event, 0))

    # -- layout conversion kernels ---------------------------------------------------------

    def prepare_conversions(
        self,
        packs: Sequence[tuple[TensorSpec, np.dtype[Any]]],
        unpacks: Sequence[tuple[TensorSpec, np.dtype[Any]]],
    ) -> None:
        from ._conversion_kernels import ConversionKernels  # NVRTC only when asked for

        try:
            kernels = ConversionKernels.compile(packs, unpacks, device=self.device)
        except ValueError as exc:  # a tensor the kernels cannot take (odd strides, say)
            raise RuntimeUnavailableError(
                f"the GPU layout conversion cannot serve: {exc}"
            ) from None
        for spec, _ in (*packs, *unpacks):
            self._kernels[id(spec)] = (spec, kernels)

    def _conversion_kernels(self, spec: TensorSpec) -> ConversionKernels:
        entry = self._kernels.get(id(spec))
        if entry is None:
            raise CudaCallError("cudaLaunchKernel", _INVALID_VALUE)
        return entry[1]

    def pack(
        self,
        spec: TensorSpec,
        source: np.dtype[Any],
        src: int,
        src_strides: tuple[int, int, int, int],
        dst: int,
        stream: int,
    ) -> None:
        self._conversion_kernels(spec).pack(spec, source, src, src_strides, dst, stream)
        self.counts.conversions += 1

    def unpack(
        self, spec: TensorSpec, result: np.dtype[Any], src: int, dst: int, stream: int
    ) -> None:
        self._conversion_kernels(spec).unpack(spec, result, src, dst, stream)
        self.counts.conversions += 1

    def prepare_preprocess(self, targets: Sequence[tuple[TensorSpec, Preprocessing]]) -> None:
        from ._preprocess_kernels import PreprocessKernels  # NVRTC only when asked for

        kernels = PreprocessKernels.compile(targets, device=self.device)
        for spec, _ in targets:
            self._preprocess[id(spec)] = (spec, kernels)

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
        entry = self._preprocess.get(id(spec))
        if entry is None:
            raise CudaCallError("cudaLaunchKernel", _INVALID_VALUE)
        entry[1].launch(spec, frame, height, width, pitch, dst, stream)
        self.counts.conversions += 1

    # -- detector post-processing kernels ---------------------------------------------------

    def prepare_detect(self, plan: DetectPlan) -> DetectKernels:
        from ._detect_kernels import DetectKernels  # NVRTC only when asked for

        try:
            return DetectKernels.compile(plan, device=self.device)
        except ValueError as exc:  # a head the kernels cannot read (odd strides, say)
            raise RuntimeUnavailableError(f"the GPU post-processing cannot serve: {exc}") from None

    def detect(
        self,
        program: DetectKernels,
        heads: Sequence[int],
        work: int,
        out: int,
        stream: int,
        geometry: Geometry | None = None,
        frame_size: tuple[int, int] | None = None,
    ) -> None:
        program.launch(heads, work, out, stream, geometry, frame_size)

    def close(self) -> None:
        """Nothing to stop: the CUDA runtime holds no threads of its own. Idempotent.

        Handles the engine created are the engine's to release; pinned buffers still
        allocated here stay valid (the engine frees them in its close).
        """
        self._closed = True
