"""``Engine(isolation="process")``: the runtime in a supervised worker process."""

from ._remote import NO_CUDA_IPC as NO_CUDA_IPC
from ._remote import RemoteDevice as RemoteDevice
from ._remote import open_remote as open_remote
from ._supervisor import Supervisor as Supervisor
from ._supervisor import WorkerState as WorkerState
from ._supervisor import inject_fault as inject_fault

__all__ = (
    "NO_CUDA_IPC",
    "RemoteDevice",
    "Supervisor",
    "WorkerState",
    "inject_fault",
    "open_remote",
)
