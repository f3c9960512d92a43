"""What a detector export's decode tail computes, and how its exporter reads the result.

:func:`export_output` is the tail of each family, written from its exporter's source:
the compiler holds a graph's tail against it (a cut is accepted only when the removed
nodes compute exactly this), and the tests build their graphs to it.
:func:`exporter_detections` decodes a full export's output as its exporter documents
(``non_max_suppression`` of Ultralytics, ``postprocess`` of YOLOX): the reference that
``aiodla verify --export`` holds the trimmed model and :class:`aiodla.Detect` against.

- ``"yolov5"`` (Ultralytics YOLOv5 v7.0 ``models/yolo.py`` ``Detect.forward``): per
  scale and anchor a, cell (y, x), ``s = sigmoid(head)``; ``cx = (s0 * 2 - 0.5 + x) *
  stride``, ``w = (s2 * 2) ** 2 * anchor_w`` (likewise y, h); output ``(1, N, 5 + nc)``:
  cx, cy, w, h, objectness, class probabilities, rows in (scale, anchor, y, x) order.
  Exporter: candidates where objectness > conf; score = objectness * class probability,
  the best class, score > conf; class-aware NMS.
- ``"yolov8"`` (Ultralytics 8.x ``nn/modules/head.py`` ``Detect._inference``, also
  YOLOv5u and YOLO11): DFL distances ``d = sum(softmax(bins) * j)`` per side,
  anchor point (x + 0.5, y + 0.5); ``x1y1 = p - lt``, ``x2y2 = p + rb``; output ``(1, 4
  + nc, N)``: ``(x1y1 + x2y2) / 2 * stride``, ``(x2y2 - x1y1) * stride``, sigmoid of the
  class logits. Exporter: score = best class probability > conf; class-aware NMS.
- ``"yolox"`` (Megvii YOLOX 0.3.0 ``yolo_head.py`` ``decode_outputs``): the head holds
  box, sigmoid objectness, sigmoid classes; ``cx = (t0 + x) * stride``, ``w = exp(t2) *
  stride``; output ``(1, N, 5 + nc)``. Exporter (``utils/boxes.py`` ``postprocess``):
  score = objectness * best class probability >= conf; class-aware NMS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._detect_math import Candidates, select

__all__ = ["FAMILIES", "MATCH_IOU", "export_output", "exporter_detections", "match"]

_Array = np.ndarray[Any, Any]

#: Two detections are one object when their IoU reaches this (:func:`match`).
MATCH_IOU = 0.5
#: The decodings a cut can remove, by the Detect head that replaces them.
FAMILIES = ("yolov5", "yolov8", "yolox")


def _grid(height: int, width: int) -> tuple[_Array, _Array]:
    y, x = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    return x.ravel().astype(np.float64), y.ravel().astype(np.float64)


def _sigmoid(x: _Array) -> _Array:
    return 1.0 / (1.0 + np.exp(-x))


def export_output(
    family: str,
    heads: Sequence[_Array],
    strides: Sequence[int],
    *,
    anchors: Sequence[Sequence[float]] | None = None,
    reg_max: int = 16,
) -> _Array:
    """The export's output for raw ``heads`` ((1, C, h, w) each, stride order), in
    float64, laid out as the exporter lays it out (module docstring)."""
    parts = []
    for k, (head, stride) in enumerate(zip(heads, strides, strict=True)):
        t = np.asarray(head, np.float64)[0]
        channels, height, width = t.shape
        gx, gy = _grid(height, width)
        flat = t.reshape(channels, -1)
        if family == "yolov5":
            pairs = np.asarray((anchors or ())[k], np.float64).reshape(-1, 2)
            per = channels // len(pairs)
            for a, (aw, ah) in enumerate(pairs):
                s = _sigmoid(flat[a * per : (a + 1) * per])
                cx = (s[0] * 2 - 0.5 + gx) * stride
                cy = (s[1] * 2 - 0.5 + gy) * stride
                w, h = (s[2] * 2) ** 2 * aw, (s[3] * 2) ** 2 * ah
                parts.append(np.column_stack([cx, cy, w, h, s[4:].T]))
        elif family == "yolov8":
            bins = flat[: 4 * reg_max].reshape(4, reg_max, -1)
            e = np.exp(bins - bins.max(axis=1, keepdims=True))
            d = (e * np.arange(reg_max)[None, :, None]).sum(1) / e.sum(1)
            px, py = gx + 0.5, gy + 0.5
            x1, y1, x2, y2 = px - d[0], py - d[1], px + d[2], py + d[3]
            box = np.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1]) * stride
            parts.append(np.vstack([box, _sigmoid(flat[4 * reg_max :])]).T)
        elif family == "yolox":
            cx, cy = (flat[0] + gx) * stride, (flat[1] + gy) * stride
            w, h = np.exp(flat[2]) * stride, np.exp(flat[3]) * stride
            parts.append(np.column_stack([cx, cy, w, h, flat[4:].T]))
        else:
            raise ValueError(f"family {family!r} is not one of {FAMILIES}")
    rows = np.concatenate(parts)[None]
    return rows.transpose(0, 2, 1) if family == "yolov8" else rows


def exporter_detections(
    family: str,
    output: _Array,
    *,
    conf: float = 0.25,
    iou: float = 0.45,
    max_det: int = 300,
) -> tuple[_Array, _Array, _Array]:
    """A full export's ``output`` decoded as its exporter does (module docstring): the
    kept boxes (x1, y1, x2, y2 in input pixels), scores and classes, best first. NMS is
    torchvision's (``batched_nms``: by class), which :func:`aiodla._detect_math.select`
    reproduces."""
    out = np.asarray(output, np.float32)
    rows = out[0].T if family == "yolov8" else out[0]
    if family == "yolov8":
        probabilities = rows[:, 4:]
        objectness = None
    else:
        objectness = rows[:, 4]
        probabilities = rows[:, 5:] * objectness[:, None]
    classes = np.argmax(probabilities, axis=1).astype(np.int32)
    scores = probabilities[np.arange(len(rows)), classes].astype(np.float32)
    if family == "yolox":
        keep = scores >= np.float32(conf)
    else:
        keep = scores > np.float32(conf)
        if objectness is not None:
            keep &= objectness > np.float32(conf)
    cx, cy, w, h = (rows[:, i] for i in range(4))
    half_w, half_h = w / np.float32(2), h / np.float32(2)
    boxes = np.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], 1).astype(np.float32)
    ids = np.flatnonzero(keep).astype(np.int64)
    found = Candidates(boxes[keep], scores[keep], classes[keep], ids)
    kept = select(found, iou=iou, max_det=max_det, max_candidates=30000, class_agnostic=False)
    return found.boxes[kept], found.scores[kept], found.classes[kept]


def _iou(box: np.ndarray[Any, Any], boxes: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    w = np.clip(np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0]), 0, None)
    h = np.clip(np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1]), 0, None)
    inter = w * h
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        iou = np.asarray(inter / (area + areas - inter), np.float64)
    return np.where(np.isfinite(iou), iou, 0.0)  # a box beyond float range matches nothing


def match(
    got: tuple[Any, Any, Any], want: tuple[Any, Any, Any]
) -> tuple[int, list[float], list[float]]:
    """Reference detections matched to ``got`` (same class, IoU >= 0.5, best first, each
    once): the count, the IoUs and the score differences of the matched."""
    boxes, scores, classes = (np.asarray(a) for a in got)
    free = np.ones(len(scores), bool)
    ious: list[float] = []
    errors: list[float] = []
    for box, score, cls in zip(*(np.asarray(a) for a in want), strict=True):
        overlap = np.where(free & (classes == cls), _iou(box, boxes.reshape(-1, 4)), -1.0)
        if not len(overlap) or overlap.max() < MATCH_IOU:
            continue
        best = int(np.argmax(overlap))
        free[best] = False
        ious.append(float(overlap[best]))
        errors.append(abs(float(scores[best]) - float(score)))
    return len(ious), ious, errors
