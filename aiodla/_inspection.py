"""What the command line asks of a runtime outside any engine: a loadable's tensor
descriptors, the runtime's version and cores. A part of the device layer (it
calls the runtime), kept apart from the engine's cores and slots.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._descriptors import TensorDescriptor
from ._errors import AiodlaError, ConfigurationError
from ._local_device import device_error
from ._resources import ResourceStack
from .emulator._format import MAGIC
from .runtime import _select
from .runtime._protocol import Runtime

__all__ = [
    "DLA_RESOURCE",
    "auto_choice",
    "close_runtime",
    "describe_module",
    "describe_runtime",
    "dla_resources",
    "version_text",
]

#: The Ray custom resource that counts a box's DLA cores (``ray start --resources``).
DLA_RESOURCE = "DLA"


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


def version_text(version: int) -> str:
    # cuDLA packs its version as major * 1_000_000 + minor * 1_000 + patch.
    return f"{version // 1_000_000}.{version // 1_000 % 1_000}.{version % 1_000} ({version})"


def auto_choice(loadable: bytes) -> str:
    """What runtime="auto" picks for this kind of loadable, or why it picks none."""
    try:
        runtime, owned = _select.select_runtime("auto", loadable)
    except AiodlaError as exc:
        return f"none: {exc}"
    if owned:
        close_runtime(runtime)
    return runtime.name


def dla_resources(runtime: str = "auto") -> dict[str, float]:
    """What ``ray start --resources`` should get on this box: ``{"DLA": cores}``.

    ``"auto"`` counts the DLA cores cuDLA drives here (a Jetson: 2), or returns ``{}``
    where there is none, so that no replica of a real loadable lands on this box.
    ``"cuda"`` counts them too, and raises where cuDLA is not usable. ``"emulated"``
    gives the emulated runtime's cores, for fleets that serve emulator loadables.

    The CLI prints it as JSON: ``aiodla devices --ray-resources``; ``aiodla.ray``
    re-exports it as ``ray_resources``.
    """
    if runtime not in _select.RUNTIME_CHOICES:
        raise ConfigurationError(f"runtime={runtime!r} must be one of {_select.RUNTIME_CHOICES}")
    if runtime == "auto" and not _select.cuda_probe()[0]:
        return {}
    # The emulated runtime is chosen only for an emulator loadable (its magic stands for
    # one, as in the CLI's devices command); b"" stands for a DLA loadable.
    probe = MAGIC if runtime == "emulated" else b""
    chosen, _owned = _select.select_runtime(runtime, probe)  # a name: always ours to close
    try:
        _version, cores = describe_runtime(chosen)
    finally:
        close_runtime(chosen)
    return {DLA_RESOURCE: float(cores)}
