"""Choosing a runtime: ``runtime="auto" | "cuda" | "emulated"`` or an instance.

"auto" takes cuDLA for what only cuDLA reads and the emulator for emulator loadables;
when neither fits, the error says what is known about the model and nothing more.
"""

from __future__ import annotations

from .._errors import ConfigurationError, RuntimeUnavailableError
from ..emulator._format import is_emulator_loadable
from ._emulated import EmulatedRuntime
from ._protocol import Runtime

__all__ = ["RUNTIME_CHOICES", "cuda_probe", "not_an_emulator_loadable", "select_runtime"]

RUNTIME_CHOICES = ("auto", "cuda", "emulated")
ORIN_DLA_CORES = 2


def not_an_emulator_loadable(what: str, reason: str) -> str:
    """Why bytes that are not an emulator loadable cannot run here, saying only what is
    known: nothing but cuDLA could tell whether they are a DLA loadable."""
    return (
        f"{what} is not an emulator loadable; if it is a DLA loadable, it needs cuDLA "
        f"(libcudla.so.1, on a Jetson), which is not usable here: {reason}"
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


def select_runtime(choice: str | Runtime, loadable: bytes) -> tuple[Runtime, bool]:
    """The runtime for this loadable, and whether the caller owns (must close) it."""
    if not isinstance(choice, str):
        if not isinstance(choice, Runtime):
            raise ConfigurationError(
                f"runtime={choice!r} must be one of {RUNTIME_CHOICES} or a Runtime instance"
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
        return EmulatedRuntime(cores=ORIN_DLA_CORES), True
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
        return EmulatedRuntime(cores=ORIN_DLA_CORES), True
    raise RuntimeUnavailableError(not_an_emulator_loadable("the model", reason))


def _cuda_runtime() -> Runtime:
    from ._cuda import CudaRuntime

    return CudaRuntime()
