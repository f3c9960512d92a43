"""Detector post-processing as an engine option: :class:`Detect` (what the heads are and
how to threshold them, validated in one place) and :class:`Detections` (what ``infer``
returns then: boxes, scores and classes of the kept detections).

``Engine(model, preprocess={"images": ImagePreprocess(...)}, postprocess=Detect(
head="yolov5", classes=80))``. At open, :meth:`Detect.plan` matches the model's outputs
to the heads (by name with ``outputs=``, else by spatial size) and refuses a mismatch
with a ConfigurationError naming the tensor. The arithmetic is defined in
:mod:`aiodla._detect_math`, whose numpy code and the CUDA kernels both follow it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._detect_math import (
    Candidates,
    HeadLayout,
    decode_cells,
    frame_boxes,
    gather,
    inside_frame,
    merge,
    select,
)
from ._errors import ConfigurationError

if TYPE_CHECKING:
    from ._preprocess import Geometry
    from ._tensors import TensorSpec

__all__ = ["Detect", "DetectPlan", "Detections"]

# Head name -> the kind of arithmetic (aliases share one: YOLOv7 decodes as YOLOv5,
# YOLO11 as YOLOv8).
_KINDS = {
    "yolov5": "yolov5",
    "yolov7": "yolov5",
    "yolov8": "yolov8",
    "yolo11": "yolov8",
    "yolox": "yolox",
    "boxes": "boxes",
}
# The reference implementations' anchors (w, h pairs per stride 8, 16, 32), in pixels.
YOLOV5_ANCHORS = (
    (10, 13, 16, 30, 33, 23),
    (30, 61, 62, 45, 59, 119),
    (116, 90, 156, 198, 373, 326),
)
YOLOV7_ANCHORS = (
    (12, 16, 19, 36, 40, 28),
    (36, 75, 76, 55, 72, 146),
    (142, 110, 192, 243, 459, 401),
)
_DEFAULT_STRIDES = (8, 16, 32)
_MAX_CLASSES = 1 << 16
_MAX_CANDIDATES = 1 << 16  # the kernels' suppression bitmask grows as the square of it
# head="boxes": (4 + classes) x N, or N x (4 + classes)
_LAYOUTS = {"columns": "(4 + classes) x N", "rows": "N x (4 + classes)"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Detect:
    """Post-processing of an object detector's heads into :class:`Detections`.

    ``head`` names the decoding, each with its tensor layout (one output per stride
    unless said otherwise; channel-major, ``(1, channels, H, W)`` logical shape):

    - ``"yolov5"`` / ``"yolov7"``: anchor-based, ``len(anchors[k]) // 2 * (5 +
      classes)`` channels per head (x, y, w, h, objectness, classes per anchor, raw
      logits); ``anchors=`` (w, h pairs per stride) default to YOLOv5s' / YOLOv7's.
    - ``"yolov8"`` / ``"yolo11"``: anchor-free, ``4 * reg_max + classes`` channels per
      head: the box branch's DFL bins (left, top, right, bottom, ``reg_max`` each) then
      the class logits.
    - ``"yolox"``: anchor-free, ``5 + classes`` channels (box, then objectness and class
      probabilities, as YOLOX exports them: sigmoid applied in the model).
    - ``"boxes"``: one output of N candidates, each ``4 + classes`` values (cx, cy, w, h,
      class scores): threshold and NMS only. Either layout: ``(4 + classes) x N``
      (``layout="columns"``, as YOLOv8 exports ``1 x 84 x 8400``: the values are the
      channels, every spatial position a candidate) or ``N x (4 + classes)``
      (``layout="rows"``, as many NMS-free exports: a candidate's values are the last
      dimension, or the last two). By default the output's shape decides: the layout
      whose ``4 + classes`` is the leading dimension(s) (columns) or the trailing ones
      (rows) of its logical shape; a shape that fits both (N equal to ``4 + classes``)
      or neither is a ConfigurationError at open naming the tensor.

    ``strides`` (default 8, 16, 32) give each head's scale; heads match the model's
    outputs by name when ``outputs=`` names them (in stride order), else by spatial size
    (input size / stride). ``conf``: a candidate's score must exceed it; ``iou``: NMS
    suppresses a box overlapping a better one of its class (of any class with
    ``class_agnostic=True``) by more; at most ``max_det`` detections are kept.

    ``max_candidates`` (default 4096) caps the candidates NMS sees: past it the best by
    score are kept (ties by candidate index) and the rest dropped, never an error. The
    GPU path's suppression bitmask takes ``max_candidates**2 / 8`` bytes a slot (2 MiB
    at the default). The arithmetic is :mod:`aiodla._detect_math`'s docstring.
    """

    head: str
    classes: int = 80
    conf: float = 0.25
    iou: float = 0.45
    max_det: int = 300
    anchors: tuple[tuple[float, ...], ...] | None = None
    strides: tuple[int, ...] | None = None
    reg_max: int = 16
    class_agnostic: bool = False
    outputs: tuple[str, ...] | None = None
    max_candidates: int = 4096
    layout: str | None = None

    def __post_init__(self) -> None:
        head = self.head
        if head not in _KINDS:
            raise ConfigurationError(f"{head=} is not one of {', '.join(map(repr, _KINDS))}")
        kind = _KINDS[head]
        for name, low, high in (
            ("classes", 1, _MAX_CLASSES),
            ("max_det", 1, _MAX_CANDIDATES),
            ("reg_max", 1, 64),
            ("max_candidates", 1, _MAX_CANDIDATES),
        ):
            value: object = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigurationError(f"{name}={value!r} must be an integer")
            if not low <= int(value) <= high:
                raise ConfigurationError(f"{name}={value!r} must be within {low}..{high}")
            object.__setattr__(self, name, int(value))
        for name in ("conf", "iou"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ConfigurationError(f"{name}={value!r} must be a number")
            if not 0.0 <= float(value) < 1.0 and not (name == "iou" and value == 1.0):
                raise ConfigurationError(f"{name}={value!r} must be within [0, 1)")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.class_agnostic, bool):
            raise ConfigurationError(f"class_agnostic={self.class_agnostic!r} must be a bool")
        if self.max_det > self.max_candidates:
            raise ConfigurationError(
                f"max_det={self.max_det} must not exceed max_candidates={self.max_candidates}"
            )
        self._check_strides(kind)
        self._check_anchors(kind)
        if self.layout is not None:
            if kind != "boxes":
                raise ConfigurationError(f"layout= is for head='boxes', not {head!r}")
            if self.layout not in _LAYOUTS:
                raise ConfigurationError(
                    f"layout={self.layout!r} is not one of {', '.join(map(repr, _LAYOUTS))}"
                )
        outputs: object = self.outputs
        if outputs is not None:
            if isinstance(outputs, str) or not isinstance(outputs, Sequence):
                raise ConfigurationError(f"outputs={outputs!r} must be a sequence of names")
            if not all(isinstance(name, str) and name for name in outputs):
                raise ConfigurationError(f"outputs={outputs!r} must hold non-empty names")
            if len(set(outputs)) != len(outputs):
                raise ConfigurationError(f"outputs={outputs!r} names a tensor twice")
            heads = 1 if kind == "boxes" else len(self.strides or ())
            if len(outputs) != heads:
                raise ConfigurationError(
                    f"outputs={tuple(outputs)!r} names {len(outputs)} tensors; "
                    f"head={head!r} with strides={self.strides} has {heads}"
                )
            object.__setattr__(self, "outputs", tuple(outputs))

    @classmethod
    def for_model(cls, model: str | os.PathLike[str], **thresholds: Any) -> Detect:
        """The Detect that ``aiodla compile`` wrote beside the loadable ``model``
        (``MODEL.bin.detect.json``): the head, classes, strides, anchors, ``reg_max`` and
        output names of the tail the compiler cut. ``thresholds`` set ``conf``, ``iou``,
        ``max_det``, ``max_candidates`` and ``class_agnostic``; ConfigurationError for
        any other keyword, or a missing or malformed settings file."""
        from ._compiled import THRESHOLDS, read_settings

        unknown = sorted(set(thresholds) - set(THRESHOLDS))
        if unknown:
            raise ConfigurationError(
                f"Detect.for_model takes the thresholds {', '.join(THRESHOLDS)}; "
                f"{', '.join(unknown)} come from the compiled model"
            )
        document = read_settings(model)
        settings = dict(document["detect"])
        for key in ("strides", "outputs"):
            if isinstance(settings.get(key), list):
                settings[key] = tuple(settings[key])
        if isinstance(settings.get("anchors"), list):
            settings["anchors"] = tuple(
                tuple(row) if isinstance(row, list) else row for row in settings["anchors"]
            )
        try:
            return cls(**{**settings, **thresholds})
        except TypeError as exc:
            raise ConfigurationError(
                f"{os.fspath(model)}.detect.json: its detect settings do not fit Detect ({exc})"
            ) from None

    def _check_strides(self, kind: str) -> None:
        strides: object = self.strides
        if kind == "boxes":
            if strides is not None:
                raise ConfigurationError(f"{strides=} is for grid heads, not head='boxes'")
            return
        if strides is None:
            strides = _DEFAULT_STRIDES
        if isinstance(strides, (str, bytes)) or not isinstance(strides, Sequence) or not strides:
            raise ConfigurationError(f"{strides=} must be a non-empty sequence of integers")
        for value in strides:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigurationError(f"{strides=}: {value!r} is not a positive integer")
        if list(strides) != sorted(set(strides)):
            raise ConfigurationError(f"{strides=} must be increasing, each once")
        object.__setattr__(self, "strides", tuple(int(value) for value in strides))

    def _check_anchors(self, kind: str) -> None:
        anchors: object = self.anchors
        if kind != "yolov5":
            if anchors is not None:
                raise ConfigurationError(f"anchors= is for anchor-based heads, not {self.head!r}")
            return
        if anchors is None:
            anchors = YOLOV7_ANCHORS if self.head == "yolov7" else YOLOV5_ANCHORS
        strides = self.strides or ()
        if isinstance(anchors, (str, bytes)) or not isinstance(anchors, Sequence):
            raise ConfigurationError(f"{anchors=} must hold a sequence of w, h values per stride")
        if len(anchors) != len(strides):
            raise ConfigurationError(
                f"{anchors=} has {len(anchors)} entries, one per stride of {strides=} needed"
            )
        checked = []
        row: object
        for row in anchors:
            if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
                raise ConfigurationError(f"anchors entry {row!r} must be w, h pairs")
            if not row or len(row) % 2:
                raise ConfigurationError(f"anchors entry {row!r} must hold w, h pairs")
            value: object
            for value in row:
                if (
                    isinstance(value, bool)
                    or not isinstance(value, numbers.Real)
                    or not math.isfinite(value)
                    or value <= 0
                ):
                    raise ConfigurationError(f"anchors entry {row!r}: {value!r} is not > 0")
            checked.append(tuple(float(value) for value in row))
        object.__setattr__(self, "anchors", tuple(checked))

    @property
    def kind(self) -> str:
        """The decoding: ``"yolov5"``, ``"yolov8"``, ``"yolox"`` or ``"boxes"``."""
        return _KINDS[self.head]

    def channels(self, anchors: int = 1) -> int:
        """Channels a head of this configuration has (``anchors`` per cell for yolov5)."""
        kind = self.kind
        if kind == "yolov5":
            return anchors * (5 + self.classes)
        if kind == "yolov8":
            return 4 * self.reg_max + self.classes
        return (5 if kind == "yolox" else 4) + self.classes

    def plan(self, input_size: tuple[int, int], outputs: Sequence[TensorSpec]) -> DetectPlan:
        """The heads matched to the model's outputs for an input of ``input_size`` (H, W).

        ConfigurationError naming the tensor for a missing head, a name ``outputs=``
        gives that the model lacks, a grid that is not input size / stride, or a
        channel count that does not fit."""
        by_name = {spec.name: spec for spec in outputs}
        names = ", ".join(by_name) or "none"
        kind = self.kind
        strides: tuple[int | None, ...] = (None,) if kind == "boxes" else self.strides or ()
        chosen: list[TensorSpec] = []
        for k, stride in enumerate(strides):
            if self.outputs is not None:
                spec = by_name.get(self.outputs[k])
                if spec is None:
                    raise ConfigurationError(
                        f"Detect(outputs=...) names {self.outputs[k]!r}, which the model "
                        f"does not output (outputs: {names})"
                    )
            elif kind == "boxes":
                if len(outputs) != 1:
                    raise ConfigurationError(
                        f"head='boxes' needs outputs=(name,) for a model of {len(outputs)} "
                        f"outputs ({names})"
                    )
                spec = outputs[0]
            else:
                assert stride is not None
                grid = (input_size[0] // stride, input_size[1] // stride)
                found = [s for s in outputs if tuple(s.shape[2:]) == grid and s not in chosen]
                if not found:
                    raise ConfigurationError(
                        f"head={self.head!r}: no output of {grid[0]}x{grid[1]} for stride "
                        f"{stride} of a {input_size[0]}x{input_size[1]} input (outputs: "
                        + ", ".join(
                            f"{s.name} {s.shape[1]}x{s.shape[2]}x{s.shape[3]}" for s in outputs
                        )
                        + ")"
                    )
                spec = found[0]
            chosen.append(spec)
        layouts = []
        offset = 0
        for k, (spec, stride) in enumerate(zip(chosen, strides, strict=True)):
            n, c, h, w = spec.shape
            if n != 1:
                raise ConfigurationError(f"output {spec.name!r}: Detect takes batch 1, got {n}")
            if stride is not None and (h, w) != (input_size[0] // stride, input_size[1] // stride):
                raise ConfigurationError(
                    f"output {spec.name!r} is {h}x{w}; stride {stride} of a "
                    f"{input_size[0]}x{input_size[1]} input gives "
                    f"{input_size[0] // stride}x{input_size[1] // stride}"
                )
            pairs: tuple[tuple[float, float], ...] = ((0.0, 0.0),)
            if kind == "boxes":  # one output, its candidates read as 1 x N
                rows, count = self._read_boxes(spec)
                layout = HeadLayout(kind, 1, count, 1.0, pairs, 0, self.classes, self.reg_max, rows)
            else:
                if kind == "yolov5":
                    row = (self.anchors or ())[k]
                    pairs = tuple((row[i], row[i + 1]) for i in range(0, len(row), 2))
                expected = self.channels(len(pairs))
                if c != expected:
                    raise ConfigurationError(
                        f"output {spec.name!r} has {c} channels; head={self.head!r} with "
                        f"classes={self.classes}{_what(self, len(pairs))} needs {expected}"
                    )
                layout = HeadLayout(
                    kind, h, w, float(stride or 1), pairs, offset, self.classes, self.reg_max
                )
            offset += layout.cells
            layouts.append(layout)
        return DetectPlan(self, tuple(chosen), tuple(layouts), input_size)

    def _read_boxes(self, spec: TensorSpec) -> tuple[bool, int]:
        """How a ``"boxes"`` output holds its candidates: whether as rows (N x (4 +
        classes)), and N. The values of a candidate are the leading dimensions of the
        logical shape (columns) or the trailing ones (rows); ``layout=`` says which,
        else the shape, when it fits one only."""
        _, c, h, w = spec.shape
        per = 4 + self.classes
        fits = {"columns": per in (c, c * h), "rows": per in (w, h * w)}
        shape = "x".join(map(str, spec.shape))
        count = c * h * w // per
        if self.layout is not None:
            if not fits[self.layout]:
                where = "channels (or channels x height)" if self.layout == "columns" else (
                    "a last dimension (or height x width)"
                )  # fmt: skip
                raise ConfigurationError(
                    f"output {spec.name!r} is {shape}; head='boxes' with classes="
                    f"{self.classes} and layout={self.layout!r} ({_LAYOUTS[self.layout]}) "
                    f"needs {where} of {per}"
                )
            return self.layout == "rows", count
        if fits["columns"] and fits["rows"] and count > 1:
            raise ConfigurationError(
                f"output {spec.name!r} is {shape}: with classes={self.classes} it reads as "
                f"(4 + classes) x N and as N x (4 + classes), N = {count}; say which with "
                "Detect(layout='columns') or Detect(layout='rows')"
            )
        if not (fits["columns"] or fits["rows"]):
            raise ConfigurationError(
                f"output {spec.name!r} is {shape}; head='boxes' with classes={self.classes} "
                f"needs {per} values a candidate: {per} channels ((4 + classes) x N) or a "
                f"last dimension of {per} (N x (4 + classes))"
            )
        return not fits["columns"], count


def _what(detect: Detect, anchors: int) -> str:
    if detect.kind == "yolov5":
        return f" and {anchors} anchors"
    if detect.kind == "yolov8":
        return f" and reg_max={detect.reg_max}"
    return ""


@dataclasses.dataclass(frozen=True)
class DetectPlan:
    """A :class:`Detect` matched to one model: the output per head, in stride order."""

    detect: Detect
    specs: tuple[TensorSpec, ...]
    layouts: tuple[HeadLayout, ...]
    input_size: tuple[int, int]  # the model input's height and width

    @property
    def cells(self) -> int:
        """Candidate indices in all: every cell of every head."""
        return sum(layout.cells for layout in self.layouts)

    def candidates(self, heads: Sequence[Any]) -> Candidates:
        """Steps 2-4 over every head's logical array, in stride order."""
        conf = self.detect.conf
        cells = merge(
            [gather(layout, head, conf) for layout, head in zip(self.layouts, heads, strict=True)]
        )
        if cells is None:
            return Candidates.empty()
        return decode_cells(self.detect.kind, self.detect.reg_max, cells, conf)

    def run(
        self,
        heads: Sequence[Any],
        geometry: Geometry | None = None,
        frame_size: tuple[int, int] | None = None,
    ) -> Detections:
        """The numpy path: heads (logical arrays, in the order of ``specs``) to
        Detections, in frame pixels when ``geometry`` and ``frame_size`` are given (and
        then without the boxes that have nothing inside the frame)."""
        found = self.candidates(heads)
        frame = None
        if geometry is not None and frame_size is not None:
            frame = (geometry.top, geometry.left, geometry.scale_y, geometry.scale_x, *frame_size)
            # before ranking and NMS: a box in the padding must neither take a place
            # under max_candidates nor suppress a box of the frame (_detect_math, step 4)
            found = inside_frame(found, *frame)
        detect = self.detect
        kept = select(
            found,
            iou=detect.iou,
            max_det=detect.max_det,
            max_candidates=detect.max_candidates,
            class_agnostic=detect.class_agnostic,
        )
        boxes = found.boxes[kept]
        if frame is not None:
            boxes = frame_boxes(boxes, *frame)
        return Detections(
            boxes,
            found.scores[kept],
            found.classes[kept],
            outside=found.outside,
            not_finite=found.not_finite,
        )


class Detections:
    """The kept detections of one frame, best score first.

    ``boxes`` (N x 4 float32: x1, y1, x2, y2), ``scores`` (N float32) and ``classes``
    (N int32), N <= ``max_det``; in the frame's pixels when the engine pre-processes the
    input with a geometry, else in model-input pixels. ``len(d)``; ``for box, score,
    cls in d``; ``d.to_dict()`` gives plain lists. With ``output="device"`` the three
    arrays are device arrays (see :class:`~aiodla.DeviceArray`).

    Every kept box has an area inside the frame: candidates (cells whose score passed
    ``conf``) dropped before ranking and NMS are counted, ``outside`` those whose box
    has nothing inside the frame (in the letterbox padding; counted only when the boxes
    are mapped into a frame) and ``not_finite`` those whose score or box was not finite
    (an overflow in the model).
    """

    __slots__ = ("boxes", "classes", "not_finite", "outside", "scores")

    def __init__(
        self, boxes: Any, scores: Any, classes: Any, *, outside: int = 0, not_finite: int = 0
    ) -> None:
        self.boxes = boxes
        self.scores = scores
        self.classes = classes
        self.outside = outside
        self.not_finite = not_finite

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def __iter__(self) -> Iterator[tuple[Any, float, int]]:
        boxes, scores, classes = (np.asarray(a) for a in (self.boxes, self.scores, self.classes))
        for i in range(len(scores)):
            yield boxes[i], float(scores[i]), int(classes[i])

    def to_dict(self) -> dict[str, list[Any]]:
        """``{"boxes": [[x1, y1, x2, y2], ...], "scores": [...], "classes": [...]}``."""
        return {
            "boxes": np.asarray(self.boxes).tolist(),
            "scores": np.asarray(self.scores).tolist(),
            "classes": np.asarray(self.classes).tolist(),
        }

    def __repr__(self) -> str:
        dropped = "".join(
            f", {count} {what}"
            for count, what in (
                (self.outside, "outside the frame"),
                (self.not_finite, "not finite"),
            )
            if count
        )
        return f"<Detections [{len(self)} boxes{dropped}]>"
