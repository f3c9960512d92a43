"""The device layer as the engine and the flow see it: one opened object.

Opening gives a :class:`DeviceLayer` whose cores, slots, tensors and data path are set:
:class:`~aiodla._local_device.LocalDevice` drives the runtime in this process,
:class:`~aiodla._isolation.RemoteDevice` hands slots to a worker process that does.
The flow's completions (a :class:`CompletionSource`) come from the poller of the
engine's :class:`aiodla.Cores` in-process, or from the worker's supervisor, which
``RemoteDevice.start`` binds to the flow (a :class:`CompletionSink`). Runtime failures
become aiodla errors here, once (:func:`device_error`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ._device_arrays import DeviceSource
from ._errors import AiodlaError, DeviceError, EngineClosedError, status_name
from ._preprocess import ImagePreprocess
from ._slots import CoreLane, Slot, account
from ._statistics import EngineHealth, LatencyWindow, WorkerStatistics
from ._tensors import TensorSpec
from .runtime._protocol import CudaCallError, Runtime, cudla_status

if TYPE_CHECKING:
    from ._postprocess import Postprocess

__all__ = [
    "CompletionSink",
    "CompletionSource",
    "DeviceLayer",
    "NotOpen",
    "device_error",
    "is_sticky",
]


class CompletionSource(Protocol):
    """What tells the flow which slots finished: the poller in-process, the worker's
    supervisor with ``isolation="process"``."""

    def watch(self, slot: Slot) -> None: ...
    def harvest(self, at_least: int | None = None) -> list[tuple[Slot, int]]: ...
    def consumed(self) -> None: ...
    def stop(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


class CompletionSink(Protocol):
    """What a device layer tells the flow, on the loop's thread."""

    def on_completions(self, finished: list[tuple[Slot, int]]) -> None: ...
    def fail_submission(self, slot: Slot, exc: BaseException) -> bool: ...
    def fail_running(self, error: AiodlaError) -> None: ...
    def release(self, slot: Slot) -> None: ...
    def cancel_probes(self) -> None: ...
    def transition(self) -> None: ...
    def worker_lost(self) -> None: ...
    def worker_replaced(self) -> None: ...


class DeviceLayer(Protocol):
    """The cores of one engine as opened, wherever their runtime runs.

    ``release`` blocks (the engine runs it in a worker thread); the rest runs on the
    event loop's thread.
    """

    lanes: list[CoreLane]  # its lane on each core
    slots: list[Slot]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    preprocessing: tuple[ImagePreprocess | None, ...]  # each input's, if it takes frames
    stated_service_time: float | None  # what the loadable says, if anything
    # Engine(postprocess=...) matched to the model, once; read_outputs applies it.
    postprocess: Postprocess | None
    stage_windows: tuple[LatencyWindow, ...] | None  # with stage_times=True
    # A failure of the emulated runtime's compute function, by slot (None when no
    # module of this engine has one: nothing to ask with each completion then).
    take_compute_failure: Callable[[Slot], BaseException | None] | None

    @property
    def runtime(self) -> Runtime:
        """The runtime in this process (an error where it runs in another)."""
        ...

    @property
    def detects_on_stream(self) -> bool:
        """The model's heads are decoded into detections on the slots' streams: a
        request's results are the few boxes kept, not its outputs."""
        ...

    def write_inputs(self, slot: Slot, arrays: Sequence[Any], limit: int | None = None) -> bool: ...
    def write_zeros(self, slot: Slot) -> None: ...
    def read_outputs(self, slot: Slot) -> Any: ...
    def import_device(self, spec: TensorSpec, value: Any) -> DeviceSource: ...
    def frame_buffers(self, count: Any, shape: Any, dtype: Any) -> list[Any]: ...
    def check_device_output(self, postprocess: bool = False) -> None: ...
    def recycle(self, slot: Slot) -> None: ...
    def submit(self, slot: Slot, now: float) -> None: ...
    def retire(self, slot: Slot, now: float) -> bool: ...
    def account(self, slot: Slot, status: int, now: float) -> None: ...
    def release(self, keep: tuple[int, ...] = ()) -> None: ...
    def abandon(self) -> None: ...
    def health(self) -> EngineHealth | None: ...
    def statistics(self) -> WorkerStatistics | None: ...


def device_error(doing: str, exc: BaseException) -> AiodlaError | None:
    """The aiodla error for a runtime failure while ``doing`` (a phrase such as
    ``"core 1: submitting the request"``), or None when ``exc`` is no device failure.

    The one translation from runtime exceptions to aiodla errors: a CUDA error or a
    cuDLA status becomes a :class:`DeviceError` carrying it.
    """
    if isinstance(exc, AiodlaError):
        return exc
    if isinstance(exc, CudaCallError):
        return DeviceError(f"{doing} failed: {exc}", cuda_error=exc.code)
    status = cudla_status(exc)
    if status is None:
        return None
    detail = getattr(exc, "detail", None)  # the emulated runtime says what it caught
    return DeviceError(
        f"{doing} failed: {status_name(status)}" + (f" ({detail})" if detail else ""),
        status=status,
    )


def is_sticky(exc: BaseException) -> bool:
    """True for a CUDA error that leaves the process's CUDA context unusable."""
    return isinstance(exc, CudaCallError) and exc.sticky


class NotOpen:
    """The device layer of an engine not open yet: no cores, no slots; what needs a
    device says the engine is not open."""

    def __init__(self) -> None:
        self.lanes: list[CoreLane] = []
        self.slots: list[Slot] = []
        self.inputs: tuple[TensorSpec, ...] = ()
        self.outputs: tuple[TensorSpec, ...] = ()
        self.preprocessing: tuple[ImagePreprocess | None, ...] = ()
        self.detects_on_stream = False
        self.stated_service_time: float | None = None
        self.postprocess: Postprocess | None = None
        self.stage_windows: tuple[LatencyWindow, ...] | None = None
        self.take_compute_failure: Callable[[Slot], BaseException | None] | None = None

    @property
    def runtime(self) -> Runtime:
        raise EngineClosedError("the engine is not open: its runtime is not chosen yet")

    def write_inputs(self, slot: Slot, arrays: Sequence[Any], limit: int | None = None) -> bool:
        raise EngineClosedError("the engine is not open")

    def write_zeros(self, slot: Slot) -> None:
        raise EngineClosedError("the engine is not open")

    def read_outputs(self, slot: Slot) -> Any:
        raise EngineClosedError("the engine is not open")

    def import_device(self, spec: TensorSpec, value: Any) -> DeviceSource:
        raise EngineClosedError("the engine is not open")

    def frame_buffers(self, count: Any, shape: Any, dtype: Any) -> list[Any]:
        raise EngineClosedError("the engine is not open")

    def check_device_output(self, postprocess: bool = False) -> None:
        raise EngineClosedError("the engine is not open")

    def recycle(self, slot: Slot) -> None:
        """Nothing was held."""

    def submit(self, slot: Slot, now: float) -> None:
        raise EngineClosedError("the engine is not open")

    def retire(self, slot: Slot, now: float) -> bool:
        return False

    def account(self, slot: Slot, status: int, now: float) -> None:
        account(slot, status, now)

    def release(self, keep: tuple[int, ...] = ()) -> None:
        """Nothing was opened."""

    def abandon(self) -> None:
        """Nothing runs."""

    def health(self) -> EngineHealth | None:
        return None

    def statistics(self) -> WorkerStatistics | None:
        return None
