"""Choosing a runtime: ``runtime="auto" | "cuda" | "emulated"`` or an instance.

"auto" takes cuDLA for what only cuDLA reads and the emulator for emulator loadables;
when neither fits, the error says what is known about the model and nothing more. Files
that are recognisably models of another kind (ONNX, a TensorRT engine) are refused up
front with how to build a DLA loadable from them, whatever the runtime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._errors import ConfigurationError, ModelError, RuntimeUnavailableError
from ..emulator._format import is_emulator_loadable, stated_latency
from ._emulated import EmulatedRuntime
from ._protocol import Runtime

__all__ = [
    "RUNTIME_CHOICES",
    "cuda_probe",
    "foreign_model",
    "load_library",
    "loaded_libraries",
    "not_an_emulator_loadable",
    "refuse_foreign_model",
    "select_runtime",
]

RUNTIME_CHOICES = ("auto", "cuda", "emulated")
ORIN_DLA_CORES = 2


def not_an_emulator_loadable(what: str, reason: str) -> str:
    """Why bytes that are not an emulator loadable cannot run here, saying only what is
    known: nothing but cuDLA could tell whether they are a DLA loadable."""
    return (
        f"{what} is not an emulator loadable; if it is a DLA loadable, it needs cuDLA "
        f"(libcudla.so.1, on a Jetson), which is not usable here: {reason}"
    )


# -- models of another kind --------------------------------------------------------------

# A TensorRT plan starts with this tag; Ultralytics' .engine files put a JSON header
# (its length in 4 little-endian bytes) in front of one.
_TENSORRT_MAGIC = b"ftrt"
# ONNX's ModelProto fields by wire type: varints (ir_version, model_version) and
# length-delimited ones (producer, domain, doc string, graph, opsets, metadata,
# training info, functions, configuration). An ONNX file holds nothing else at the top.
_ONNX_VARINT_FIELDS = frozenset({1, 5})
_ONNX_BYTES_FIELDS = frozenset({2, 3, 4, 6, 7, 8, 14, 20, 25, 26})
_ONNX_IR_VERSION, _ONNX_GRAPH = 1, 7

BUILD_A_LOADABLE = (
    "build a DLA loadable from the ONNX model with TensorRT on the Jetson: trtexec "
    "--onnx=model.onnx --useDLACore=0 --buildDLAStandalone --saveEngine=model.bin --fp16 "
    "--inputIOFormats=fp16:chw16 --outputIOFormats=fp16:chw16 (with --int8: int8:chw32, "
    "or int8:dla_hwc4 for an image input)"
)


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The protobuf varint at ``at`` and where the next field starts; -1 if cut short."""
    value = shift = 0
    while at < len(data) and shift < 64:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7
    return 0, -1


def _is_onnx(data: bytes) -> bool:
    """Whether ``data`` parses whole as an ONNX ModelProto's top-level fields, with an
    IR version and a graph (random bytes fail within a few fields)."""
    seen: set[int] = set()
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if at < 0:
            return False
        if wire == 0 and number in _ONNX_VARINT_FIELDS:
            _value, at = _varint(data, at)
        elif wire == 2 and number in _ONNX_BYTES_FIELDS:
            length, at = _varint(data, at)
            if at < 0 or at + length > len(data):
                return False
            at += length
        else:
            return False
        if at < 0:
            return False
        seen.add(number)
    return {_ONNX_IR_VERSION, _ONNX_GRAPH} <= seen


def foreign_model(data: bytes) -> str | None:
    """What ``data`` is when it is a model of a kind aiodla recognises but does not run
    (a phrase: "an ONNX model"), else None."""
    view = bytes(data[:4096])
    if view.startswith(_TENSORRT_MAGIC):
        return "a TensorRT engine (plan) file"
    header = int.from_bytes(view[:4], "little")
    if 0 < header < len(data) - 8 and data[4 + header : 8 + header] == _TENSORRT_MAGIC:
        return "a TensorRT engine (plan) file"
    if data[:1] == b"\x08" and _is_onnx(bytes(data)):
        return "an ONNX model"
    return None


def refuse_foreign_model(data: bytes, what: str) -> None:
    """Raise a ModelError naming ``data``'s kind and how to build a DLA loadable, when
    it is a model of another kind (``what`` names the model: "the model", a path)."""
    kind = foreign_model(data)
    if kind == "an ONNX model":
        raise ModelError(f"{what} is an ONNX model, not a DLA loadable; {BUILD_A_LOADABLE}")
    if kind is not None:
        raise ModelError(
            f"{what} is a TensorRT engine (plan) file, not a DLA loadable: cuDLA loads "
            "only the standalone loadables that TensorRT builds with --buildDLAStandalone; "
            f"{BUILD_A_LOADABLE}"
        )


def cuda_probe() -> tuple[bool, str, bool]:
    """(usable, reason, is_standin): can the CUDA runtime drive at least one DLA here?"""
    try:
        from ._cuda import probe
    except ImportError as exc:  # pragma: no cover - only when cuda.bindings.runtime is broken
        return False, f"the CUDA runtime cannot be imported ({exc})", False
    usable, reason = probe()
    standin = False
    if usable:
        from ..emulator._standin import standin_loaded

        standin = standin_loaded()
    return usable, reason, standin


def select_runtime(
    choice: str | Runtime, loadable: bytes, *, trust_compute: bool = False
) -> tuple[Runtime, bool]:
    """The runtime for this loadable, and whether the caller owns (must close) it.
    ``trust_compute``: an emulated runtime made here imports the loadable's compute
    reference (a runtime passed in decides that itself)."""
    refuse_foreign_model(loadable, "the model")
    if not isinstance(choice, str):
        if not isinstance(choice, Runtime):
            raise ConfigurationError(
                f"runtime={choice!r} must be one of {RUNTIME_CHOICES} or a Runtime instance"
            )
        if trust_compute:
            raise ConfigurationError(
                "trust_compute=True applies to the runtime the engine makes; a runtime "
                "passed in decides itself: EmulatedRuntime(trust_compute=True)"
            )
        return choice, False
    if choice not in RUNTIME_CHOICES:
        raise ConfigurationError(f"runtime={choice!r} must be one of {RUNTIME_CHOICES}")
    emulator_model = is_emulator_loadable(loadable)
    if choice == "emulated":
        if not emulator_model:
            raise RuntimeUnavailableError(
                "the emulated runtime runs emulator loadables only, and this is not one; "
                "run a DLA loadable on a Jetson (runtime='cuda')"
            )
        return EmulatedRuntime(cores=ORIN_DLA_CORES, trust_compute=trust_compute), True
    usable, reason, standin = cuda_probe()
    if choice == "cuda":
        if not usable:
            raise RuntimeUnavailableError(f"runtime='cuda' is not available: {reason}")
        return _cuda_runtime(), True
    # auto: a real DLA for real loadables; the emulator for emulator loadables, unless
    # the libcudla present is aiodla's GPU stand-in, which reads them.
    if usable and (standin or not emulator_model):
        return _cuda_runtime(), True
    if emulator_model:
        return EmulatedRuntime(cores=ORIN_DLA_CORES, trust_compute=trust_compute), True
    raise RuntimeUnavailableError(not_an_emulator_loadable("the model", reason))


def _cuda_runtime() -> Runtime:
    from ._cuda import CudaRuntime

    # With the GPU stand-in this runtime loads emulator loadables, which state it.
    return CudaRuntime(states=stated_latency)


# -- a worker process's libraries (isolation="process") -----------------------------------


def loaded_libraries() -> dict[Path, Any]:
    """The cuDLA libraries this process loaded by path (GPU stand-ins), each with its
    test controls: a worker process must load the same before it opens a runtime."""
    from ..emulator._standin import loaded_standins

    return dict(loaded_standins())


def load_library(path: str) -> None:
    """Load the cuDLA library at ``path`` (a GPU stand-in), before anything binds
    ``cuda.bindings.cudla`` to a library."""
    from ..emulator._standin import load_standin

    load_standin(path)
