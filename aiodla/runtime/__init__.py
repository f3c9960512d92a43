"""Runtimes behind the engine's seam: the emulated one and the CUDA one.

``CudaRuntime`` is imported lazily: it needs ``cuda.bindings.runtime`` and, to do
anything, a GPU and ``libcudla.so.1``.
"""

from typing import TYPE_CHECKING, Any

from ._emulated import EmulatedRuntime as EmulatedRuntime
from ._faults import EmulatedCudlaError as EmulatedCudlaError
from ._faults import TaskGate as TaskGate
from ._protocol import ComputeFunctions as ComputeFunctions
from ._protocol import CudaCallError as CudaCallError
from ._protocol import FaultControls as FaultControls
from ._protocol import GraphCapture as GraphCapture
from ._protocol import HostBuffer as HostBuffer
from ._protocol import HostRegistration as HostRegistration
from ._protocol import Kernels as Kernels
from ._protocol import Runtime as Runtime

if TYPE_CHECKING:
    from ._cuda import CudaRuntime as CudaRuntime

__all__ = (
    "ComputeFunctions",
    "CudaCallError",
    "CudaRuntime",
    "EmulatedCudlaError",
    "EmulatedRuntime",
    "FaultControls",
    "GraphCapture",
    "HostBuffer",
    "HostRegistration",
    "Kernels",
    "Runtime",
    "TaskGate",
)


def __getattr__(name: str) -> Any:
    if name == "CudaRuntime":
        from ._cuda import CudaRuntime

        return CudaRuntime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
