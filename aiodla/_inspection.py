"""What the command line asks of a runtime outside any engine: a loadable's tensor
descriptors, the runtime's version and cores. A part of the device layer (it
calls the runtime), kept apart from the engine's cores and slots.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._cores import device_error
from ._descriptors import TensorDescriptor
from ._resources import ResourceStack
from .runtime._protocol import Runtime

__all__ = ["close_runtime", "describe_module", "describe_runtime"]


def describe_module(
    runtime: Runtime, model: bytes
) -> tuple[Sequence[TensorDescriptor], Sequence[TensorDescriptor]]:
    """Load ``model`` on core 0, read its tensor descriptors, release everything. A
    runtime failure is a :class:`DeviceError` saying which call failed."""
    resources = ResourceStack()
    try:
        runtime.make_current()
        device = runtime.create_device(0)
        resources.push("device", 0, runtime.destroy_device, device)
        module = runtime.load_module(device, model)
        resources.push("module", 0, runtime.unload_module, module)
        return runtime.module_tensors(module)
    except Exception as exc:
        error = device_error("reading the loadable's tensors with cuDLA", exc)
        if error is None or error is exc:
            raise
        raise error from exc
    finally:
        resources.release_all()


def describe_runtime(runtime: Runtime) -> tuple[int, int]:
    """The runtime's cuDLA version (major * 1_000_000 + minor * 1_000 + patch) and how
    many DLA cores it drives."""
    return runtime.version(), runtime.device_count()


def close_runtime(runtime: Runtime) -> None:
    """Release what the runtime itself holds (threads, libraries)."""
    runtime.close()
