"""One model on one DLA core, set up through the Runtime protocol alone.

The steps of NVIDIA's cuDLAHybridMode sample: create the device, load the loadable,
read its descriptors, cudaMalloc and register each tensor, allocate pinned staging
buffers, build the task; then per request copy in, submit, copy out on one stream.
Because it speaks only the protocol it runs the same on the emulated runtime and on
the CUDA runtime, which is how the two are held to the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from aiodla._tensors import TensorSpec


class ModelSetup:
    """Device, module, buffers, registrations, stream, event and task for one core."""

    def __init__(self, runtime: Any, core: int, loadable: bytes, *, timeout_ms: int | None = None):
        self.runtime = runtime
        self.core = core
        self._undo: list[tuple[Any, tuple[Any, ...]]] = []
        try:
            self.device = self._keep(runtime.create_device(core), runtime.destroy_device)
            if timeout_ms is not None:
                runtime.set_task_timeout(self.device, timeout_ms)
            self.module = self._keep(
                runtime.load_module(self.device, loadable), runtime.unload_module
            )
            descriptors = runtime.module_tensors(self.module)
            self.inputs = [TensorSpec.from_descriptor(d) for d in descriptors[0]]
            self.outputs = [TensorSpec.from_descriptor(d) for d in descriptors[1]]
            self.stream = self._keep(runtime.create_stream(), runtime.destroy_stream)
            self.event = self._keep(runtime.create_event(), runtime.destroy_event)
            self.device_in = [self._malloc(spec.size) for spec in self.inputs]
            self.device_out = [self._malloc(spec.size) for spec in self.outputs]
            self.registered_in = [
                self._register(p, s.size) for p, s in zip(self.device_in, self.inputs, strict=True)
            ]
            self.registered_out = [
                self._register(p, s.size)
                for p, s in zip(self.device_out, self.outputs, strict=True)
            ]
            self.host_in = [self._host(spec.size) for spec in self.inputs]
            self.host_out = [self._host(spec.size) for spec in self.outputs]
            self.task = runtime.make_task(self.module, self.registered_in, self.registered_out)
        except BaseException:
            self.close()
            raise

    def _keep(self, handle: Any, release: Any, *args: Any) -> Any:
        self._undo.append((release, (*args, handle)))
        return handle

    def _malloc(self, nbytes: int) -> int:
        return int(self._keep(self.runtime.malloc(nbytes), self.runtime.free))

    def _register(self, pointer: int, nbytes: int) -> int:
        registered = int(self.runtime.mem_register(self.device, pointer, nbytes))
        self._undo.append((self.runtime.mem_unregister, (self.device, registered)))
        return registered

    def _host(self, nbytes: int) -> Any:
        return self._keep(self.runtime.host_alloc(nbytes), self.runtime.host_free)

    # -- requests ------------------------------------------------------------------------

    def fill_outputs(self, pattern: int) -> None:
        """Write ``pattern`` into every byte of the device output buffers (synchronously)."""
        for host, device, spec in zip(self.host_out, self.device_out, self.outputs, strict=True):
            host.array[: spec.size] = pattern
            self.runtime.copy_to_device(device, host, spec.size, self.stream)
        self.runtime.synchronize_stream(self.stream)

    def enqueue(self, buffers: Sequence[bytes], stream: int | None = None) -> None:
        """Copy in, submit, copy out and record the event, on ``stream`` (default: own)."""
        runtime = self.runtime
        on = self.stream if stream is None else stream
        for host, device, spec, data in zip(
            self.host_in, self.device_in, self.inputs, buffers, strict=True
        ):
            host.array[: spec.size] = np.frombuffer(data, dtype=np.uint8, count=spec.size)
            runtime.copy_to_device(device, host, spec.size, on)
        runtime.submit_task(self.device, self.task, on)
        for host, device, spec in zip(self.host_out, self.device_out, self.outputs, strict=True):
            runtime.copy_to_host(host, device, spec.size, on)
        runtime.record_event(self.event, on)

    def results(self) -> list[bytes]:
        return [
            host.array[: spec.size].tobytes()
            for host, spec in zip(self.host_out, self.outputs, strict=True)
        ]

    def run(self, buffers: Sequence[bytes]) -> tuple[list[bytes], int]:
        """One request, synchronously: (output bytes, the device's last-error status)."""
        self.enqueue(buffers)
        self.runtime.synchronize_stream(self.stream)
        return self.results(), int(self.runtime.get_last_error(self.device))

    def close(self) -> None:
        """Release everything in reverse order of creation; raise the first failure."""
        first: BaseException | None = None
        while self._undo:
            release, args = self._undo.pop()
            try:
                release(*args)
            except BaseException as exc:  # keep releasing the rest
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> ModelSetup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
