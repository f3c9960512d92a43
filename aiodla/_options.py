"""Engine options: one frozen dataclass, validated in one place."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, TypedDict

if TYPE_CHECKING:
    from ._batching import Batching
    from ._detect import Detect
    from ._preprocess import ImagePreprocess

from ._errors import ConfigurationError

__all__ = [
    "WEIGHT_RANGE",
    "EngineKeywords",
    "EngineOptions",
    "ProcessIsolation",
    "check_timeout",
]

DEFAULT_OFFLOAD_BYTES = 256 * 1024
DEFAULT_TRACE_CAPACITY = 100_000
# The weights an engine may have: a million to one between the extremes keeps every
# engine's share of core time meaningful (a weight of 1e-16 would round every other
# engine's share to nothing) and the fair-queuing tags small integers.
WEIGHT_RANGE = (0.001, 1000.0)


@dataclasses.dataclass(frozen=True)
class ProcessIsolation:
    """``Engine(isolation=ProcessIsolation(...))``: the runtime, the CUDA context and
    every cuDLA handle live in a supervised worker process that is replaced when it is
    lost (only its in-flight requests fail, with :class:`~aiodla.WorkerLostError`);
    ``isolation="process"`` is this with its defaults.

    ``max_restarts``: how many replacements are allowed within ``restart_window``
    seconds before the engine is dead. ``heartbeat_timeout``: seconds a worker may stay
    silent before it is taken for hung, killed and replaced.
    """

    max_restarts: int = 5
    restart_window: float = 60.0
    heartbeat_timeout: float = 5.0

    def __post_init__(self) -> None:
        _whole(self.max_restarts, "max_restarts", 0, None)
        if not _finite(self.restart_window) or not self.restart_window > 0:
            raise ConfigurationError(f"restart_window={self.restart_window!r} must be seconds > 0")
        if not _finite(self.heartbeat_timeout) or not self.heartbeat_timeout > 0:
            raise ConfigurationError(
                f"heartbeat_timeout={self.heartbeat_timeout!r} must be seconds > 0"
            )


# ProcessIsolation's settings: given flat to Engine, each is pointed to it.
_PROCESS_SETTINGS = tuple(field.name for field in dataclasses.fields(ProcessIsolation))


class EngineKeywords(TypedDict, total=False):
    """The keywords ``Engine(model, ...)`` takes beside ``runtime``, with their types, so
    a type checker refuses a misspelt or mistyped option (what each means and its
    default: :class:`EngineOptions`). Type a wrapper's own ``**options`` with it:
    ``def open_engine(path: str, **options: Unpack[EngineKeywords]) -> Engine``."""

    cores: Iterable[int]  # or an aiodla.Cores (or its subset), which iterates its numbers
    streams_per_core: int
    max_queue: int
    task_timeout: float | None
    close_timeout: float
    scales: Mapping[str, float]
    offload_bytes: int
    latency_window: int
    max_consecutive_faults: int | None
    probe_interval: float
    stage_times: bool
    casting: Literal["safe", "same_kind"]
    convert: Literal["auto", "device", "host"]
    zero_copy: bool | None
    preprocess: Mapping[str, ImagePreprocess]
    postprocess: Detect | None
    isolation: Literal["thread", "process"] | ProcessIsolation
    graphs: bool
    trust_compute: bool
    trace: str | os.PathLike[str] | None
    trace_capacity: int
    priority: int
    weight: float
    batch: Batching | None


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How an :class:`~aiodla.Engine` runs.

    ``cores``: the DLA cores to use (Orin has 0 and 1). ``streams_per_core``: slots per
    core, so copies of one request overlap the DLA work of another; for tasks well under
    a millisecond use more (4 and 8 were measured at 100 us on the GPU stand-in), so a
    core's queued work outlasts the event loop's round trip. ``max_queue``: how
    many requests may wait for a slot before ``infer_nowait`` refuses more (``infer``
    waits its turn instead). ``task_timeout``: seconds before the DLA aborts a task
    (cuDLA's own default, 30 s, when None). ``close_timeout``: seconds ``aclose`` lets
    in-flight tasks finish. ``scales``: INT8/INT16 quantization step per tensor name.
    ``offload_bytes``: packing or unpacking that moves more bytes than this on the host
    runs in a worker thread instead of on the event loop (a device array, a camera frame
    the kernels read in place from a frame buffer, and detections decoded on the stream
    move next to none: they stay on the loop). ``latency_window``: how many recent
    requests the latency percentiles cover. ``max_consecutive_faults``: after this many
    failed tasks in a row, a core leaves rotation (while another core serves) until a
    probe task, tried every ``probe_interval`` seconds, succeeds; None keeps every core
    in rotation. ``stage_times``: measure copy-in, DLA and copy-out time of every request
    with timing events (a few microseconds of host time per request). ``casting``: how
    input arrays of another dtype go into float tensors: ``"safe"`` refuses any value
    the tensor's type would lose (1e6 into float16, say), ``"same_kind"`` is numpy's
    rule (such values become infinity); see :meth:`TensorSpec.check_array`.
    ``convert``: where layout conversion runs: ``"device"`` as kernels on each slot's
    CUDA stream (the host copies only the caller's bytes; device arrays are read where
    they lie), ``"host"`` with numpy on the event loop (or a worker thread), ``"auto"``
    the device on a runtime with GPU memory, else the host. ``zero_copy``: with device
    conversion, kernels read and write mapped pinned staging in place and no copy is
    enqueued; None (the default) does so on an integrated GPU (a Jetson).
    ``preprocess``: input name -> :class:`~aiodla.ImagePreprocess`: that input takes
    camera frames (any size up to its ``max_frame``), resized, normalized and converted
    as it says. ``postprocess``: a :class:`~aiodla.Detect`: ``infer`` returns
    :class:`~aiodla.Detections` decoded from the model's heads (in the frame's pixels
    when ``preprocess`` feeds the image input).
    ``isolation``: where the runtime, the CUDA context and every cuDLA handle live:
    ``"thread"`` in this process (a sticky CUDA error kills the engine), or a
    :class:`ProcessIsolation` (``"process"`` is one with its defaults, kept here as
    that object: :attr:`process_isolation`) for a supervised worker process.
    ``graphs``: each slot captures the work around its
    task (copies, conversions, its event) into a graph the first time a request of a
    kind runs there, and enqueues the graph, one call, for every later one; False
    enqueues each call every time. ``trust_compute``: let the emulated runtime the
    engine makes import and run the compute function an emulator loadable names
    (``module:function``); a model file is data, so without it such a model is refused.
    ``trace``: a path: the engine records its timeline from open to close (as
    ``engine.trace()`` does for a block) and writes it there as Chrome trace-event JSON
    when it closes; the path is written at open (a valid, empty trace), so one that
    cannot be written fails the open. ``trace_capacity``: how many requests and poller
    sweeps that trace keeps (the newest; memory stays bounded however long it runs).
    ``priority`` and ``weight``: on cores shared with other engines
    (``Engine(model, cores=aiodla.Cores(...))``), a request of a higher priority starts
    before any waiting request of a lower one, and engines of one priority share core
    time in proportion to their weights, each from 0.001 to 1000 (see ``aiodla._dispatch``
    for the rule and its bound); on cores of its own an engine has nobody to share
    with. ``batch``: an :class:`~aiodla.Batching`: for a model of batch N > 1, callers
    may pass single items, which are assembled into tasks of N (see
    ``aiodla._batching``).
    """

    cores: tuple[int, ...] = (0, 1)
    streams_per_core: int = 2
    max_queue: int = 1024
    task_timeout: float | None = None
    close_timeout: float = 10.0
    scales: Mapping[str, float] = dataclasses.field(default_factory=dict)
    offload_bytes: int = DEFAULT_OFFLOAD_BYTES
    latency_window: int = 4096
    max_consecutive_faults: int | None = None
    probe_interval: float = 1.0
    stage_times: bool = False
    trust_compute: bool = False
    casting: str = "safe"
    convert: str = "auto"
    zero_copy: bool | None = None
    preprocess: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    postprocess: Any = None
    isolation: str | ProcessIsolation = "thread"
    graphs: bool = True
    trace: str | os.PathLike[str] | None = None
    trace_capacity: int = DEFAULT_TRACE_CAPACITY
    priority: int = 0
    weight: float = 1.0
    batch: Any = None

    @property
    def process_isolation(self) -> ProcessIsolation | None:
        """The worker process's settings, or None when the runtime is in this process."""
        isolation = self.isolation
        return isolation if isinstance(isolation, ProcessIsolation) else None

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any]) -> EngineOptions:
        """The options named by ``Engine(model, **keywords)``, ``isolation`` a mode or a
        :class:`ProcessIsolation`; an unknown keyword is a :class:`ConfigurationError`
        that names it (and the nearest known one)."""
        known = [field.name for field in dataclasses.fields(cls)]
        for name in keywords:
            if name in _PROCESS_SETTINGS:
                raise ConfigurationError(
                    f"{name} is a setting of the worker process: pass "
                    f"isolation=aiodla.ProcessIsolation({name}=...)"
                )
            if name not in known:
                offered = known
                near = difflib.get_close_matches(name, [*known, *_PROCESS_SETTINGS], n=1)
                if not near:
                    hint = f"; options are {offered}"
                elif near[0] in _PROCESS_SETTINGS:
                    hint = f"; did you mean isolation=aiodla.ProcessIsolation({near[0]}=...)?"
                else:
                    hint = f"; did you mean {near[0]!r}?"
                raise ConfigurationError(f"unknown engine option {name!r}{hint}")
        return cls(**keywords)

    def __post_init__(self) -> None:
        cores: object = self.cores  # checked as given: callers pass lists, ranges, ...
        if isinstance(cores, int) or not isinstance(cores, Iterable):
            raise ConfigurationError(f"{cores=} must be a sequence of DLA core numbers")
        cores = tuple(cores)
        if not cores or any(type(c) is not int or c < 0 for c in cores):
            raise ConfigurationError(f"{cores=} must be one or more ints >= 0")
        if len(set(cores)) != len(cores):
            raise ConfigurationError(f"{cores=} names a core twice")
        object.__setattr__(self, "cores", cores)
        _whole(self.streams_per_core, "streams_per_core", 1, 16)
        _whole(self.max_queue, "max_queue", 0, None)
        _whole(self.offload_bytes, "offload_bytes", 0, None)
        _whole(self.latency_window, "latency_window", 1, None)
        if self.task_timeout is not None:
            timeout = self.task_timeout
            if not _finite(timeout) or not 0.001 <= timeout <= 1000:
                raise ConfigurationError(
                    f"task_timeout={timeout!r} must be seconds in [0.001, 1000] (cuDLA's range)"
                )
        if self.max_consecutive_faults is not None:
            _whole(self.max_consecutive_faults, "max_consecutive_faults", 1, None)
        if not _finite(self.probe_interval) or not self.probe_interval > 0:
            raise ConfigurationError(f"probe_interval={self.probe_interval!r} must be seconds > 0")
        if self.casting not in ("safe", "same_kind"):
            raise ConfigurationError(f"casting={self.casting!r} must be 'safe' or 'same_kind'")
        if self.convert not in ("auto", "device", "host"):
            raise ConfigurationError(f"convert={self.convert!r} must be 'auto', 'device' or 'host'")
        if self.zero_copy is not None and not isinstance(self.zero_copy, bool):
            raise ConfigurationError(f"zero_copy={self.zero_copy!r} must be True, False or None")
        if not isinstance(self.graphs, bool):
            raise ConfigurationError(f"graphs={self.graphs!r} must be True or False")
        if not isinstance(self.trust_compute, bool):
            raise ConfigurationError(f"trust_compute={self.trust_compute!r} must be a bool")
        if self.trace is not None and (
            not isinstance(self.trace, (str, os.PathLike)) or not os.fspath(self.trace)
        ):
            raise ConfigurationError(f"trace={self.trace!r} must be a file path, or None")
        _whole(self.trace_capacity, "trace_capacity", 1, None)
        if not isinstance(self.stage_times, bool):
            raise ConfigurationError(f"stage_times={self.stage_times!r} must be True or False")
        if self.isolation == "process":  # (its default settings)
            object.__setattr__(self, "isolation", ProcessIsolation())
        elif not isinstance(self.isolation, ProcessIsolation) and self.isolation != "thread":
            raise ConfigurationError(
                f"isolation={self.isolation!r} must be 'thread', 'process' or a ProcessIsolation"
            )
        if type(self.priority) is not int:
            raise ConfigurationError(
                f"priority={self.priority!r} must be an int (a higher priority runs first)"
            )
        low, high = WEIGHT_RANGE
        if not _finite(self.weight) or not low <= self.weight <= high:
            raise ConfigurationError(
                f"weight={self.weight!r} must be a number > 0, from {low:g} to {high:g} "
                "(a share of core time)"
            )
        object.__setattr__(self, "weight", float(self.weight))
        from ._batching import Batching

        if self.batch is not None and not isinstance(self.batch, Batching):
            raise ConfigurationError(f"batch={self.batch!r} must be an aiodla.Batching or None")
        if not _finite(self.close_timeout) or self.close_timeout < 0:
            raise ConfigurationError(f"close_timeout={self.close_timeout!r} must be seconds >= 0")
        from ._preprocess import ImagePreprocess  # (its module imports the tensors')

        preprocess: object = self.preprocess
        if not isinstance(preprocess, Mapping):
            raise ConfigurationError(
                f"preprocess={preprocess!r} must map input names to ImagePreprocess"
            )
        for name, value in preprocess.items():
            if not isinstance(name, str) or not isinstance(value, ImagePreprocess):
                raise ConfigurationError(
                    f"preprocess[{name!r}]={value!r} must be an ImagePreprocess for an input name"
                )
        object.__setattr__(self, "preprocess", MappingProxyType(dict(preprocess)))
        from ._detect import Detect

        if self.postprocess is not None and not isinstance(self.postprocess, Detect):
            raise ConfigurationError(f"postprocess={self.postprocess!r} must be an aiodla.Detect")
        scales = dict(self.scales)
        for name, scale in scales.items():
            if not isinstance(name, str) or not _finite(scale) or not scale > 0:
                raise ConfigurationError(
                    f"scales[{name!r}]={scale!r} must be a finite number > 0 for a tensor name"
                )
            scales[name] = float(scale)
        object.__setattr__(self, "scales", MappingProxyType(scales))


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: object, name: str, low: int, high: int | None) -> None:
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigurationError(f"{name}={value!r} must be an int {bound}")


def check_timeout(timeout: object, name: str = "timeout") -> None:
    """Refuse a request timeout that is not seconds >= 0 (None means no timeout)."""
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or math.isnan(timeout)
        or timeout < 0
    ):
        raise ConfigurationError(f"{name}={timeout!r} must be seconds >= 0, or None")
