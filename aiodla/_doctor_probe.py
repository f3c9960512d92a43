"""What ``aiodla doctor`` asks the CUDA stack, in a process of its own.

``python -m aiodla._doctor_probe`` prints one JSON object of facts and exits 0. The
doctor runs it as a subprocess with a timeout, so that a driver that hangs or a library
that crashes on load costs one clear line instead of the doctor itself. Every fact is
gathered on its own: a missing piece is an ``*_error`` string, never an exception.

Facts (every key optional; ``*_error`` instead of the value when it could not be read):
``bindings_version``, ``status_spelling`` ("ERROR_INVALID_PARAM" or "ErrorInvalidParam"),
``cudla_library`` (the file loaded), ``standin`` (bool), ``cudla_version`` (int),
``dla_cores`` (int), ``driver_version`` and ``runtime_version`` (CUDA's ints, 0 = no
driver), ``cuda_devices`` (int), ``nvrtc_version`` ("13.0"), ``nvrtc_library``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["gather"]


def _try(facts: dict[str, Any], key: str, read: Callable[[], Any]) -> None:
    try:
        facts[key] = read()
    except Exception as exc:  # every failure is a fact: the doctor reports it
        facts[f"{key}_error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _bindings_version() -> str:
    from importlib.metadata import version

    return version("cuda-bindings")


def _spelling() -> str:
    from cuda.bindings import cudla

    # 13.5 spells the members ERROR_...; 13.3 ErrorInvalidParam (13.5 keeps it as alias).
    return (
        "ERROR_INVALID_PARAM"
        if hasattr(cudla.Status, "ERROR_INVALID_PARAM")
        else ("ErrorInvalidParam")
    )


def _cudla_library() -> str:
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return str(load_nvidia_dynamic_lib("cudla").abs_path)


def _standin() -> bool:
    from .emulator._standin import standin_loaded

    return standin_loaded()


def _cuda_int(name: str) -> Callable[[], int]:
    def read() -> int:
        from cuda.bindings import runtime

        error, value = getattr(runtime, name)()[:2]
        if error != runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"{name}: {getattr(error, 'name', error)}")
        return int(value)

    return read


def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    error, major, minor = nvrtc.nvrtcVersion()
    if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion: {getattr(error, 'name', error)}")
    return f"{major}.{minor}"


def _nvrtc_library() -> str:
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return str(load_nvidia_dynamic_lib("nvrtc").abs_path)


def gather() -> dict[str, Any]:
    """Every fact this process can read about cuda-bindings, cuDLA, CUDA and NVRTC."""
    facts: dict[str, Any] = {}
    _try(facts, "bindings_version", _bindings_version)
    _try(facts, "status_spelling", _spelling)
    _try(facts, "cudla_library", _cudla_library)
    if "cudla_library" in facts:
        from cuda.bindings import cudla

        _try(facts, "standin", _standin)
        _try(facts, "cudla_version", lambda: int(cudla.get_version()))
        _try(facts, "dla_cores", lambda: int(cudla.device_get_count()))
    _try(facts, "driver_version", _cuda_int("cudaDriverGetVersion"))
    _try(facts, "runtime_version", _cuda_int("cudaRuntimeGetVersion"))
    if facts.get("driver_version"):
        _try(facts, "cuda_devices", _cuda_int("cudaGetDeviceCount"))
    _try(facts, "nvrtc_version", _nvrtc_version)
    _try(facts, "nvrtc_library", _nvrtc_library)
    return facts


if __name__ == "__main__":
    json.dump(gather(), sys.stdout)
    sys.stdout.write("\n")
