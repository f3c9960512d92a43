"""The exceptions aiodla raises, named by cause.

Every exception aiodla raises on purpose derives from :class:`AiodlaError`::

    AiodlaError
    ├── InputError                 bad request input, raised before anything is queued
    │   ├── InputValueError        (also ValueError) names, shapes, NaN into integers
    │   └── InputTypeError         (also TypeError)  not an array, dtype that cannot cast
    ├── ModelError                 (also ValueError) the loadable or its descriptors
    │   ├── LoadableFormatError    malformed emulator loadable bytes
    │   └── ComputeError           an emulated runtime's compute= function raised, or
    │                              returned outputs that do not fit the model
    ├── PostprocessError           ``postprocess=`` failed on one request's outputs
    ├── ConfigurationError         (also ValueError) a bad engine or runtime option
    ├── RuntimeUnavailableError    no runtime can serve this model on this machine
    ├── QueueFullError             ``infer_nowait`` with the admission queue full
    ├── RequestTimeoutError        (also TimeoutError and asyncio.TimeoutError) a
    │                              request's deadline passed
    ├── EngineClosedError          *you* closed the engine (or it never opened)
    ├── StreamClosedError          *you* closed a LatestFrameStream
    ├── VideoSourceError           a video source cannot be read: ``.source`` (its name,
    │                              credentials removed), ``.reason``, ``.retryable``
    ├── EngineDeadError            the device broke the engine; ``__cause__`` says how
    │   └── WorkerLostError        ``isolation="process"``: the worker process running
    │                              the request was lost (``.cause``, ``.exit_status``)
    ├── TaskError                  one DLA task failed; ``.status`` and ``.core``
    └── DeviceError                a cuDLA or CUDA call failed; ``.status`` / ``.cuda_error``

"Closed" and "dead" follow trio's closed/broken split: a closed engine is a normal
end that your code caused; a dead engine is a fault (a poisoned CUDA context) after
which only a process restart helps.
"""

from __future__ import annotations

import asyncio
import enum
import sys
from typing import Any

__all__ = [
    "AiodlaError",
    "ComputeError",
    "ConfigurationError",
    "DeviceError",
    "EngineClosedError",
    "EngineDeadError",
    "InputError",
    "InputTypeError",
    "InputValueError",
    "LoadableFormatError",
    "ModelError",
    "PostprocessError",
    "QueueFullError",
    "RequestTimeoutError",
    "RuntimeUnavailableError",
    "StreamClosedError",
    "TaskError",
    "VideoSourceError",
    "WorkerLostError",
    "status_name",
]


def status_name(status: int) -> str:
    """The cudla.Status member name for ``status``, or its number when unknown."""
    from cuda.bindings import cudla

    try:
        member: enum.Enum = cudla.Status(int(status))
    except ValueError:
        return f"cudlaStatus {int(status)}"
    return member.name


class AiodlaError(Exception):
    """Base class of every error aiodla raises on purpose."""


class InputError(AiodlaError):
    """A request's input does not fit the model; nothing was queued."""


class InputValueError(InputError, ValueError):
    """A wrong, missing or extra tensor name, a wrong shape, or a value that cannot be stored."""


class InputTypeError(InputError, TypeError):
    """An input that is not an array, or whose dtype cannot be cast safely."""


class ModelError(AiodlaError, ValueError):
    """The model cannot be served: a bad loadable or inconsistent tensor descriptors."""


class LoadableFormatError(ModelError):
    """Emulator loadable bytes that are malformed, truncated or hostile."""


class ComputeError(ModelError):
    """The emulated runtime's ``compute=`` function failed on one request: it raised
    (the exception is the ``__cause__``), or its outputs do not fit the model's output
    specs. Only that request fails; the engine goes on serving."""


class PostprocessError(AiodlaError):
    """Post-processing (``Engine(postprocess=...)``) failed on one request's outputs;
    the exception is the ``__cause__``. Only that request fails."""


class ConfigurationError(AiodlaError, ValueError):
    """An engine or runtime option is out of range; the message names the option."""


class RuntimeUnavailableError(AiodlaError):
    """No runtime on this machine can serve the model (for example, no libcudla)."""


class QueueFullError(AiodlaError):
    """``infer_nowait`` found the admission queue full."""


if sys.version_info >= (3, 11):
    # asyncio.TimeoutError is the builtin TimeoutError itself since 3.11: naming both
    # as bases would be a duplicate base class, a TypeError.
    _TimeoutErrors = TimeoutError
else:

    class _TimeoutErrors(TimeoutError, asyncio.TimeoutError):
        """On 3.10 asyncio.TimeoutError is a class apart from the builtin, and it is
        what ``asyncio.wait_for`` and ``except asyncio.TimeoutError`` expect."""


class RequestTimeoutError(AiodlaError, _TimeoutErrors):
    """The request's deadline passed before its result was ready."""


class EngineClosedError(AiodlaError):
    """The engine is closed (by you), or was never opened."""


class StreamClosedError(AiodlaError):
    """The stream is closed: *you* closed it (``aclose`` or leaving ``async with``)."""


class VideoSourceError(AiodlaError):
    """A video source cannot be read, or stopped being readable.

    ``source`` is the source's name (its URI with any credentials removed; the message
    never holds them either). ``reason`` says why in a word or two: ``"not found"``,
    ``"unauthorized"``, ``"unsupported codec"``, ``"no video"``, ``"lost"`` (an error
    or an unexpected end of a live stream), ``"stalled"`` (no frame for
    ``stall_timeout``), ``"decoder"`` (the decoder named cannot run here).
    ``retryable`` is false for what reconnecting cannot fix (the first four): a source
    raises those at once, whatever its ``reconnect``.
    """

    def __init__(self, message: str, *, source: str, reason: str, retryable: bool) -> None:
        super().__init__(message)
        self.source = source
        self.reason = reason
        self.retryable = retryable

    def __reduce__(self) -> tuple[Any, ...]:
        return (_video_source_error, (str(self), self.source, self.reason, self.retryable))


def _video_source_error(
    message: str, source: str, reason: str, retryable: bool
) -> VideoSourceError:
    return VideoSourceError(message, source=source, reason=reason, retryable=retryable)


class EngineDeadError(AiodlaError):
    """The device broke the engine; the original error is ``__cause__``.

    A sticky CUDA error such as ``cudaErrorExternalDevice`` poisons the process's CUDA
    context: NVIDIA's guidance is to restart the process.
    """


class WorkerLostError(EngineDeadError):
    """With ``isolation="process"``: the worker process that ran this request was lost
    (its CUDA context broke, it died, or it stopped answering), so the request failed.

    Unlike its base class, the engine itself lives on: queued requests wait for the
    new worker. ``cause`` says what happened in words; ``exit_status`` is the worker's
    exit status as :attr:`subprocess.Popen.returncode` gives it (negative: the signal
    that ended it), or None when it could not be learned.
    """

    def __init__(self, message: str, *, cause: str = "", exit_status: int | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.exit_status = exit_status


class TaskError(AiodlaError):
    """A DLA task finished with an error status; only this request failed."""

    def __init__(self, message: str, *, status: int, core: int) -> None:
        super().__init__(message)
        self.status = int(status)
        self.core = core

    @property
    def status_name(self) -> str:
        return status_name(self.status)


class DeviceError(AiodlaError):
    """A cuDLA or CUDA call failed outside a task (opening, registering, closing...)."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        cuda_error: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.cuda_error = cuda_error
