"""Opening the device layer: the runtime, every core's device and module, and each
slot's stream, events, registered buffers, staging and task, created in order and
remembered for release. What it opened comes out whole (:class:`Opened`); on a failure
everything created so far is released before the error propagates."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._core_record import CoreRecord
from ._data_path import DataPath, DevicePath, HostPath
from ._descriptors import TensorDescriptor
from ._device import device_error
from ._errors import ConfigurationError, ModelError, RuntimeUnavailableError
from ._graphs import Graphs
from ._options import EngineOptions
from ._postprocess import Postprocess, open_postprocess
from ._preprocess import ImagePreprocess, preprocessing_for
from ._resources import ResourceStack
from ._slots import CoreLane, Slot, new_core
from ._tensors import TensorSpec, specs_by_name
from .runtime._protocol import (
    ComputeFunctions,
    GraphCapture,
    Kernels,
    Runtime,
    check_capabilities,
    offers,
)
from .runtime._select import select_runtime

__all__ = ["Opened", "open_model", "read_model"]

logger = logging.getLogger("aiodla")


@dataclasses.dataclass(frozen=True, eq=False)
class Opened:
    """Everything one engine opened in this process, and how to release it."""

    runtime: Runtime
    owns_runtime: bool  # chosen by name: the engine made it, and closes it
    resources: ResourceStack  # every handle, in order of creation
    lanes: list[CoreLane]  # its lane on each core
    slots: list[Slot]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    preprocessing: tuple[ImagePreprocess | None, ...]  # each input's, if it takes frames
    path: DataPath
    graphs: Graphs | None  # None when Engine(graphs=False)
    take_compute_failure: Callable[[Slot], BaseException | None] | None
    stated_service_time: float | None
    # Engine(postprocess=...) matched to the model, once: on the slots' streams where
    # the path runs it there, else on the host after the unpack (``read_outputs``).
    postprocess: Postprocess | None


def read_model(model: str | os.PathLike[str] | bytes | bytearray | memoryview) -> bytes:
    """The loadable's bytes, from a path or from bytes."""
    if isinstance(model, (bytes, bytearray, memoryview)):
        data = bytes(model)
    else:
        try:
            with open(model, "rb") as file:
                data = file.read()
        except OSError as exc:
            raise ModelError(
                f"cannot read model {os.fspath(model)!r}: {exc.strerror or exc}"
            ) from exc
    if not data:
        where = "" if isinstance(model, (bytes, bytearray, memoryview)) else f" {model!r}"
        raise ModelError(f"the model{where} is empty (0 bytes): not a loadable")
    return data


def open_model(
    model: bytes,
    runtime_choice: str | Runtime,
    options: EngineOptions,
    records: Mapping[int, CoreRecord] | None = None,
) -> Opened:
    """Pick the runtime, then open every core, its module and its ring of slots
    (blocking: the engine runs it in a worker thread); each core's lane shares the
    physical core's record in ``records`` (the shared cores'; None: records of its
    own)."""
    if records is None:
        records = {number: CoreRecord(number) for number in options.cores}
    runtime, owned = select_runtime(runtime_choice, model, trust_compute=options.trust_compute)
    opening = _Opening(options, runtime, records)
    try:
        return opening.open(model, owned)
    except BaseException:
        opening.release()
        if owned:
            runtime.close()
        raise


class _Opening:
    """One open in progress: what it made so far, in order, to release on a failure."""

    def __init__(
        self, options: EngineOptions, runtime: Runtime, records: Mapping[int, CoreRecord]
    ) -> None:
        self._options = options
        self._records = records
        self.runtime = runtime
        self.resources = ResourceStack()
        self.lanes: list[CoreLane] = []
        self.slots: list[Slot] = []

    def open(self, model: bytes, owned: bool) -> Opened:
        runtime = self.runtime
        options = self._options
        check_capabilities(runtime)  # (a capability declared is whole, or nothing opens)
        self._call("make_current", runtime.make_current)
        available = self._call("device_count", runtime.device_count)
        for number in options.cores:
            if number >= available:
                raise ConfigurationError(
                    f"DLA core {number} does not exist: the {runtime.name} runtime has "
                    f"{available} core(s)"
                )
        # Capabilities are asked once, here (each declared one was checked whole when
        # the runtime was chosen): a runtime without one is served without it.
        graphs = None
        capture: GraphCapture | None = offers(runtime, GraphCapture)
        if options.graphs and capture is not None:
            graphs = Graphs(capture, self.resources)
        # An emulator loadable states its service time; a DLA loadable's is learned.
        stated = runtime.stated_service_time(model)
        first, *others = options.cores
        found = self._open_core(first, stated, model)
        inputs, outputs, preprocessing = self._specs(found)
        postprocess = open_postprocess(options, inputs, outputs)
        path = self._choose_path(inputs, outputs, preprocessing, postprocess)
        self._open_slots(self.lanes[0], path, inputs, outputs, preprocessing)
        for number in others:
            if self._open_core(number, stated, model) != found:
                raise ModelError(
                    f"core {number} reports other tensor descriptors than core "
                    f"{first}; the same loadable must describe the same tensors"
                )
            self._open_slots(self.lanes[-1], path, inputs, outputs, preprocessing)
        take = None
        computes: ComputeFunctions | None = offers(runtime, ComputeFunctions)
        if computes is not None and any(
            computes.module_computes(core.module) for core in self.lanes
        ):
            failure_of = computes.take_compute_failure

            def take(slot: Slot) -> BaseException | None:
                return failure_of(slot.stream)

        return Opened(
            runtime,
            owned,
            self.resources,
            self.lanes,
            self.slots,
            inputs,
            outputs,
            preprocessing,
            path,
            graphs,
            take,
            stated,
            postprocess,
        )

    def release(self) -> None:
        """After a failed open: release what was made, in reverse order."""
        if len(self.resources):
            try:
                self.runtime.make_current()
            except Exception as exc:  # a poisoned context: release what still can be
                logger.warning("aiodla: making the device current to close failed: %s", exc)
        failures = self.resources.release_all(())
        if failures:
            logger.warning("aiodla: %d release(s) failed while closing", len(failures))

    def _open_core(
        self, number: int, stated: float | None, model: bytes
    ) -> tuple[tuple[TensorDescriptor, ...], tuple[TensorDescriptor, ...]]:
        """Core ``number``'s device and module; the tensor descriptors it reports."""
        runtime = self.runtime
        core = new_core(number, stated, self._options, self._records[number])
        self.lanes.append(core)
        where = f"core {number}"
        core.device = self._create(
            where, number, runtime.create_device, runtime.destroy_device, number
        )
        task_timeout = self._options.task_timeout
        if task_timeout is not None:
            self._call(
                f"{where}: set_task_timeout",
                runtime.set_task_timeout,
                core.device,
                max(1, round(task_timeout * 1000)),
            )
        core.module = self._create(
            where, number, runtime.load_module, runtime.unload_module, core.device, model
        )
        descriptors = self._call(f"{where}: module_tensors", runtime.module_tensors, core.module)
        return tuple(descriptors[0]), tuple(descriptors[1])

    def _specs(
        self, descriptors: tuple[Sequence[TensorDescriptor], Sequence[TensorDescriptor]]
    ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], tuple[ImagePreprocess | None, ...]]:
        """The model's inputs and outputs (with the scales asked for), and the
        pre-processing of each input that takes camera frames."""
        inputs = tuple(TensorSpec.from_descriptor(d) for d in descriptors[0])
        outputs = tuple(TensorSpec.from_descriptor(d) for d in descriptors[1])
        by_name = specs_by_name([*inputs, *outputs])
        scales = self._options.scales
        for name in scales:
            spec = by_name.get(name)
            if spec is None:
                raise ConfigurationError(
                    f"scales names tensor {name!r}, which the model does not have; "
                    f"it has {sorted(by_name)}"
                )
            if not spec.is_integer:
                raise ConfigurationError(
                    f"scales[{name!r}]: tensor {name!r} is {spec.dtype}; only integer "
                    "tensors take a quantization scale"
                )
        inputs = tuple(s.with_scale(scales.get(s.name)) for s in inputs)
        outputs = tuple(s.with_scale(scales.get(s.name)) for s in outputs)
        return inputs, outputs, preprocessing_for(inputs, self._options.preprocess)

    def _choose_path(
        self,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        preprocessing: tuple[ImagePreprocess | None, ...],
        postprocess: Postprocess | None,
    ) -> DataPath:
        """Host or device conversion (``Engine(convert=...)``); the device path's
        conversions (and ``postprocess``, where the runtime runs it on the slots'
        streams) are made ready here, before any slot exists."""
        runtime = self.runtime
        convert = self._options.convert
        if convert == "host" or (convert == "auto" and not runtime.has_device_memory):
            return HostPath(runtime)
        kernels: Kernels | None = offers(runtime, Kernels)
        if kernels is None:
            if convert == "device":
                raise RuntimeUnavailableError(
                    f"convert='device' needs a runtime with GPU kernels; the {runtime.name} "
                    "runtime has none (Engine(convert='host') converts on the host)"
                )
            return HostPath(runtime)
        zero_copy = self._options.zero_copy
        if zero_copy is None:
            zero_copy = self._call("is_integrated", kernels.is_integrated)
        path = DevicePath(kernels, zero_copy)
        try:
            path.prepare(inputs, outputs, preprocessing)
        except RuntimeUnavailableError as exc:
            if convert == "device":
                raise
            logger.warning("aiodla: converting on the host: %s", exc)
            return HostPath(runtime)
        if postprocess is not None:  # on the slots' streams, where the runtime can
            path.prepare_detect(postprocess)
        path.ingest_stream = self._create(
            "device arrays", -1, runtime.create_stream, runtime.destroy_stream
        )
        return path

    def _open_slots(
        self,
        core: CoreLane,
        path: DataPath,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        preprocessing: tuple[ImagePreprocess | None, ...],
    ) -> None:
        for index in range(self._options.streams_per_core):
            slot = self._open_slot(core, index, path, inputs, outputs, preprocessing)
            core.slots.append(slot)
            core.idle.append(slot)
            self.slots.append(slot)

    def _open_slot(
        self,
        core: CoreLane,
        index: int,
        path: DataPath,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        preprocessing: tuple[ImagePreprocess | None, ...],
    ) -> Slot:
        runtime = self.runtime
        where = f"core {core.core} slot {index}"
        stream = self._create(where, core.core, runtime.create_stream, runtime.destroy_stream)
        timed = self._options.stage_times
        event = self._create(where, core.core, runtime.create_event, runtime.destroy_event, timed)
        timing = None
        if timed:
            marks = [
                self._create(where, core.core, runtime.create_event, runtime.destroy_event, True)
                for _ in range(3)
            ]
            timing = (marks[0], marks[1], marks[2])
        bindings = []
        for number, spec in enumerate((*inputs, *outputs)):
            what = f"{where} tensor {spec.name!r}"
            pointer = self._create(what, core.core, runtime.malloc, runtime.free, spec.size)
            registered = self._call(
                f"{what}: mem_register", runtime.mem_register, core.device, pointer, spec.size
            )
            self.resources.push(
                f"{what}: registration", core.core, runtime.mem_unregister, core.device, registered
            )

            def allocate(name: str, create: Any, release: Any, nbytes: Any) -> Any:
                return self._create(f"{where} tensor {name!r}", core.core, create, release, nbytes)

            output = number >= len(inputs)
            pre = None if output else preprocessing[number]
            bindings.append(path.bind(spec, pointer, registered, output, allocate, pre))
        ins, outs = bindings[: len(inputs)], bindings[len(inputs) :]
        task = self._call(
            f"{where}: make_task",
            runtime.make_task,
            core.module,
            [b.registered for b in ins],
            [b.registered for b in outs],
        )
        slot = Slot(core, index, stream, event, task, ins, outs, timing=timing)

        def allocate_for_slot(name: str, create: Any, release: Any, nbytes: Any) -> Any:
            return self._create(f"{where} {name}", core.core, create, release, nbytes)

        path.bind_slot(slot, allocate_for_slot)
        if path.converts_on_device:  # orders the stream after a device array's producer
            slot.ingest_event = self._create(
                where, core.core, runtime.create_event, runtime.destroy_event
            )
        return slot

    def _call(self, what: str, call: Any, *args: Any) -> Any:
        """Run one device call while opening; failures name the call and where (and the
        size, for an allocation)."""
        try:
            return call(*args)
        except Exception as exc:
            error = device_error(f"opening the engine: {what}", exc)
            if error is None or error is exc:
                raise
            if call in (self.runtime.malloc, self.runtime.host_alloc):
                error.args = (f"{error} ({args[0]} bytes asked for)",)
            raise error from exc

    def _create(self, where: str, owner: int, create: Any, release: Any, *args: Any) -> Any:
        """Create one handle and remember how to release it."""
        what = f"{where}: {create.__name__}"
        handle = self._call(what, create, *args)
        self.resources.push(what, owner, release, handle)
        return handle
