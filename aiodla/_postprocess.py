"""An engine's post-processing step: its :class:`~aiodla.Detect` matched to the model at
open, then run on each request's outputs.

``Engine(model, postprocess=Detect(...))`` makes ``infer`` return
:class:`~aiodla.Detections`. At open :func:`open_postprocess` finds the input whose size
the strides divide (the one ``preprocess`` feeds, else the model's only input) and
matches the heads (:meth:`Detect.plan`); every mismatch is a ConfigurationError naming
the tensor. Per request, :meth:`Postprocess.run` takes the outputs in the model's
order and, when that input took a camera frame through an ``ImagePreprocess``, maps the
boxes into that frame (its size read from the request's frame). This is the numpy path
(:mod:`aiodla._detect_math`), for host conversion and the worker-process engine; it
runs where the engine unpacks outputs, so off the event loop when the engine unpacks
large outputs in a worker thread. With device conversion the runtime runs the same
definition on the slot's stream instead (:mod:`aiodla._postprocess_stream`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._detect import Detect, Detections, DetectPlan
from ._errors import ConfigurationError, PostprocessError

if TYPE_CHECKING:
    from ._frame_plan import Geometry
    from ._options import EngineOptions
    from ._preprocess import ImagePreprocess
    from ._tensors import TensorSpec

__all__ = ["Postprocess", "open_postprocess"]

#: Frame sizes whose geometry is remembered; a camera that cycles through more recomputes.
_GEOMETRIES_KEPT = 64


class Postprocess:
    """A Detect matched to one model: which outputs are heads, which input is the frame."""

    def __init__(
        self,
        plan: DetectPlan,
        heads: tuple[int, ...],
        frame_input: int,
        preprocess: ImagePreprocess | None,
    ) -> None:
        self.plan = plan
        self.heads = heads  # output index of each head, in the plan's order
        self._frame_input = frame_input
        self._preprocess = preprocess
        self._size = plan.input_size
        self._geometries: dict[tuple[int, int], Geometry] = {}  # by frame size

    def run(self, outputs: Sequence[Any], inputs: Sequence[Any]) -> Detections:
        """Detections of one request: ``outputs`` (logical arrays, model order) and the
        request's ``inputs`` (to find its frame's size). Any error is a PostprocessError."""
        try:
            heads = [outputs[index] for index in self.heads]
            frame = self.frame_of(inputs)
            if frame is None:
                return self.plan.run(heads)
            return self.plan.run(heads, *frame)
        except Exception as exc:
            raise PostprocessError(f"post-processing failed: {exc}") from exc

    def frame_of(self, inputs: Sequence[Any]) -> tuple[Geometry, tuple[int, int]] | None:
        """Where the request's frame landed in the model input and its (height, width),
        when the boxes go into the frame's pixels; else None (model-input pixels)."""
        pre = self._preprocess
        if pre is None or pre.resize is None:
            return None
        size = pre._frame_size("frame", tuple(inputs[self._frame_input].shape))
        geometry = self._geometries.get(size)
        if geometry is None:
            if len(self._geometries) >= _GEOMETRIES_KEPT:
                self._geometries.clear()
            geometry = self._geometries[size] = pre.geometry(*size, *self._size)
        return geometry, size


def open_postprocess(
    options: EngineOptions, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> Postprocess | None:
    """``options.postprocess`` matched to the model (at open), None without one:
    ConfigurationError for a model whose image input cannot be told, or heads that do
    not fit."""
    detect, preprocess = options.postprocess, options.preprocess
    if detect is None:
        return None
    if not isinstance(detect, Detect):
        raise ConfigurationError(f"postprocess={detect!r} must be an aiodla.Detect")
    if preprocess:
        name = next(iter(preprocess))
        index = next(i for i, spec in enumerate(inputs) if spec.name == name)
    elif len(inputs) == 1:
        index = 0
    else:
        names = ", ".join(spec.name for spec in inputs)
        raise ConfigurationError(
            f"postprocess=Detect(...) needs to know the image input of a model with "
            f"{len(inputs)} inputs ({names}): give it preprocess={{name: ImagePreprocess}}"
        )
    image = inputs[index]
    plan = detect.plan(tuple(image.shape[2:]), outputs)  # type: ignore[arg-type]
    order = {spec.name: i for i, spec in enumerate(outputs)}
    heads = tuple(order[spec.name] for spec in plan.specs)
    return Postprocess(plan, heads, index, preprocess.get(image.name))
