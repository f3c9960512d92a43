"""What the HTTP and gRPC fronts see of the server: each served model
(:class:`ServedModel`) and the server's side of a request (:class:`Backend`, which
:class:`~._app.Server` implements). The fronts depend on this module, never on the
server's own, so the server can build its fronts without an import cycle."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .._detect import Detections
from .._engine import Engine
from .._frame_plan import _PACKED
from .._preprocess import ImagePreprocess
from ._kserve import ProtocolError, Status, WireTensor, wire_input, wire_output

__all__ = ["DETECTIONS", "PLATFORM", "VERSION", "Backend", "ServedModel", "frame_input"]

PLATFORM = "aiodla"
VERSION = "1"

_Array = np.ndarray[Any, Any]


def frame_input(name: str, preprocess: ImagePreprocess) -> WireTensor:
    """An input the engine pre-processes, as the protocol carries it: the camera frame
    itself, UINT8, H x W x channels (``bgr``/``rgb`` 3, ``bgra``/``rgba`` 4) or, for
    ``nv12``, the (H * 3/2) x W array of the Y plane then the interleaved U, V; any size
    up to ``max_frame`` (the engine refuses a larger one, naming it)."""
    if preprocess.source == "nv12":
        shape: tuple[int, ...] = (-1, -1)
    else:
        shape = (-1, -1, _PACKED[preprocess.source])
    return WireTensor(name, ("UINT8",), shape, preprocess.max_frame_nbytes)


def _detection(name: str, datatype: str, shape: tuple[int, ...], per_row: int) -> WireTensor:
    return WireTensor(name, (datatype,), shape, per_row)


#: What an engine with ``postprocess=Detect(...)`` answers, one row per kept detection
#: (N <= ``max_det``): ``boxes`` N x 4 FP32 (x1, y1, x2, y2; in the frame's pixels when
#: the engine pre-processes its input, else the model input's), ``scores`` N FP32,
#: ``classes`` N INT32, and ``count`` [N] INT32.
DETECTIONS: tuple[WireTensor, ...] = (
    _detection("boxes", "FP32", (-1, 4), 4),
    _detection("scores", "FP32", (-1,), 1),
    _detection("classes", "INT32", (-1,), 1),
    _detection("count", "INT32", (1,), 1),
)


def detection_arrays(found: Detections) -> dict[str, _Array]:
    """Detections as the :data:`DETECTIONS` outputs' values."""
    boxes = np.asarray(found.boxes, np.float32).reshape(-1, 4)
    return {
        "boxes": boxes,
        "scores": np.asarray(found.scores, np.float32).reshape(-1),
        "classes": np.asarray(found.classes, np.int32).reshape(-1),
        "count": np.array([len(boxes)], np.int32),
    }


class ServedModel:
    """One model name, its engine, and the protocol's view of its tensors: the
    model's own, or for an engine that pre-processes an input, that camera frame
    (:func:`frame_input`), and for one that post-processes (``Detect``), its
    detections (:data:`DETECTIONS`)."""

    def __init__(self, name: str, engine: Engine) -> None:
        self.name = name
        self.engine = engine
        preprocess = engine.options.preprocess
        self.inputs: dict[str, WireTensor] = {
            s.name: frame_input(s.name, preprocess[s.name])
            if s.name in preprocess
            else wire_input(s)
            for s in engine.inputs
        }
        self.detects = engine.options.postprocess is not None
        outputs = DETECTIONS if self.detects else tuple(map(wire_output, engine.outputs))
        self.outputs: dict[str, WireTensor] = {t.name: t for t in outputs}

    @property
    def ready(self) -> bool:
        return self.engine.health().status in ("ok", "degraded")

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [VERSION],
            "platform": PLATFORM,
            "inputs": [t.to_json() for t in self.inputs.values()],
            "outputs": [t.to_json() for t in self.outputs.values()],
        }

    def config(self) -> dict[str, Any]:
        """A Triton-style model configuration (what ``get_model_config`` reads): no
        batching dimension of Triton's, each tensor's full shape as its ``dims`` (-1: any
        size); for a frame input and detections, ``parameters`` say what they hold."""

        def tensors(wire: Mapping[str, WireTensor]) -> list[dict[str, Any]]:
            return [
                {"name": t.name, "data_type": f"TYPE_{t.datatype}", "dims": list(t.shape)}
                for t in wire.values()
            ]

        config: dict[str, Any] = {
            "name": self.name,
            "platform": PLATFORM,
            "backend": PLATFORM,
            "max_batch_size": 0,
            "input": tensors(self.inputs),
            "output": tensors(self.outputs),
        }
        parameters = self._parameters()
        if parameters:
            config["parameters"] = {k: {"string_value": v} for k, v in parameters.items()}
        return config

    def _parameters(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for name, preprocess in self.engine.options.preprocess.items():
            height, width = preprocess.max_frame
            found[f"{name}.source"] = preprocess.source
            found[f"{name}.max_frame"] = f"{height}x{width} (height x width, either way round)"
        detect = self.engine.options.postprocess
        if detect is not None:
            where = "frame" if self.engine.options.preprocess else "model input"
            found["boxes"] = f"x1, y1, x2, y2 in the {where}'s pixels, one row a detection"
            found["detect"] = (
                f"head={detect.head} classes={detect.classes} conf={detect.conf:g} "
                f"iou={detect.iou:g} max_det={detect.max_det}"
            )
        return found

    def answer(self, result: Any) -> Mapping[str, _Array]:
        """The engine's result as the outputs' values by name."""
        if isinstance(result, Detections):
            return detection_arrays(result)
        if isinstance(result, dict):
            return result
        return {next(iter(self.outputs)): result}

    def input_tensor(self, name: object) -> WireTensor:
        tensor = self.inputs.get(name) if isinstance(name, str) else None
        if tensor is None:
            raise ProtocolError(
                Status.INVALID_ARGUMENT,
                f"unexpected inference input {name!r} for model {self.name!r}; it takes "
                f"{list(self.inputs)}",
            )
        return tensor

    def output_tensors(self, names: Sequence[str] | None) -> list[WireTensor]:
        """The outputs to answer with: those named (in that order), or all of them."""
        if not names:
            return list(self.outputs.values())
        tensors = []
        for name in names:
            tensor = self.outputs.get(name)
            if tensor is None:
                raise ProtocolError(
                    Status.INVALID_ARGUMENT,
                    f"unexpected inference output {name!r} for model {self.name!r}; it "
                    f"gives {list(self.outputs)}",
                )
            tensors.append(tensor)
        return tensors


class Backend(Protocol):
    """The server, as its fronts use it."""

    @property
    def models(self) -> Mapping[str, ServedModel]: ...

    @property
    def max_request_bytes(self) -> int: ...

    @property
    def body_timeout(self) -> float: ...

    @property
    def header_timeout(self) -> float: ...

    @property
    def max_connections(self) -> int: ...

    @property
    def accepting(self) -> bool: ...

    def ready(self) -> bool: ...

    def server_metadata(self) -> dict[str, Any]: ...

    def model(self, name: str, version: str = "") -> ServedModel: ...

    def request(self) -> contextlib.AbstractContextManager[None]: ...

    async def infer(
        self,
        model: ServedModel,
        inputs: Mapping[str, _Array],
        outputs: Sequence[WireTensor],
        timeout: float | None,
    ) -> list[_Array]: ...
