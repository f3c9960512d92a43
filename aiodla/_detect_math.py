"""Detector post-processing defined to the bit, and its numpy implementation.

:class:`~aiodla.Detect` turns a detector's raw heads into :class:`~aiodla.Detections`.
This module is the definition both paths follow: the numpy code here (the emulated
runtime's and host conversion's implementation, vectorized: no Python loop per
candidate) and the CUDA kernels of :mod:`aiodla.runtime._detect_source`, which the
tests build as host C++ and compare with this code on the same vectors. It sits below
both (it imports numpy only), so the kernels' source takes its constants from here.

Arithmetic
----------
Every operation is one IEEE-754 float32 operation, rounded to nearest even, in the
order written, never fused into an FMA. A head value is its tensor's element as
float32 (float16 and dequantized integers convert exactly as ``TensorSpec.unpack``
does). NaN compares false everywhere: a NaN class value never wins, a NaN score never
passes.

1. ``exp32(x)``: NaN stays NaN; x is clamped to [-86, 86] (no overflow, no subnormal);
   ``n = rint(x * LOG2E)`` (ties to even), ``r = (x - n * LN2_HI) - n * LN2_LO``,
   ``p = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5``,
   ``exp32(x) = ((p * (r * r) + r) + 1) * 2**n`` (Cephes' expf; within 2 ulp of exp).
   ``sigmoid32(x) = 1 / (1 + exp32(-x))``.
2. **Cells.** Heads are taken in stride order (``Detect.strides``); a head of grid
   H x W with A anchors has A*H*W cells, cell (a, y, x) at index ``(a*H + y)*W + x``,
   after the cells of the heads before it: that is the *candidate index*. Channels of
   anchor a start at ``a * (5 + classes)`` (yolov5), a head's channel k at (y, x) is
   ``t[k]``; gx, gy, stride and the anchor's (aw, ah) are float32. A ``"boxes"`` output
   is read as a matrix of its N candidates, each 4 + classes values: candidate n's
   value k is element ``k * N + n`` of the logical array in C order (``"columns"``,
   (4 + classes) x N, as YOLOv8 exports) or element ``n * (4 + classes) + k``
   (``"rows"``, N x (4 + classes)); its candidate index is n.
3. **Class and score.** The class is the first c with the largest class value (NaN as
   -inf); ``"yolov5"``: ``score = sigmoid32(t[4]) * sigmoid32(t[5 + c])``; ``"yolox"``
   (objectness and classes are probabilities in the exported head): ``score = t[4] *
   t[5 + c]``; ``"yolov8"``: ``score = sigmoid32(t[4 * reg_max + c])``; ``"boxes"``:
   ``score = t[4 + c]``. A cell is a candidate when ``score > conf`` (strictly) and,
   for yolov5 and yolox, its objectness (``sigmoid32(t[4])``, ``t[4]``) ``> conf`` too
   (implied when class probabilities are at most 1; the kernels test it first).
4. **Boxes** (cx, cy, w, h, then ``x1 = cx - w * 0.5``, ``y1 = cy - h * 0.5``,
   ``x2 = cx + w * 0.5``, ``y2 = cy + h * 0.5``), ``s(k) = sigmoid32(t[k])``:
   yolov5: ``cx = ((s(0) * 2 - 0.5) + gx) * stride``, ``cy`` likewise with ``s(1)``,
   ``w = ((s(2) * 2) * (s(2) * 2)) * aw``, ``h`` likewise with ``s(3)`` and ah.
   yolox: ``cx = (t[0] + gx) * stride``, ``w = exp32(t[2]) * stride`` (and y, h).
   yolov8 (no centre step): per side k (left, top, right, bottom) over its reg_max bins
   b[j] = t[k * reg_max + j]: ``m = max b``, ``e[j] = exp32(b[j] - m)``, ``d = (sum of
   e[j] * j) / (sum of e[j])`` with both sums taken in order of j from 0;
   ``x1 = ((gx + 0.5) - d_left) * stride``, ``y1 = ((gy + 0.5) - d_top) * stride``,
   ``x2 = ((gx + 0.5) + d_right) * stride``, ``y2 = ((gy + 0.5) + d_bottom) * stride``.
   boxes: ``cx, cy, w, h = t[0], t[1], t[2], t[3]``. A cell that passes step 3 but
   whose score or a box coordinate is not finite (an overflow in the model: a
   ``"boxes"`` or ``"yolox"`` score of +inf) is no candidate, and is counted
   (``not_finite``): a score is a probability or a logit, so a non-finite one says the
   model's numbers broke, but only in that cell; failing the whole frame for it would
   lose the frame's real detections, and letting +inf through would put a score that
   no threshold or sort handles at the top of every result.
   **Inside the frame.** With a geometry (step 7), a candidate whose box, mapped into
   the frame and clipped, has no area (``x2 <= x1`` or ``y2 <= y1`` after step 7's
   arithmetic: a box wholly in the letterbox padding, or of no width) is no candidate
   either, and is counted (``outside``). This comes before steps 5 and 6: such a box is
   no object of the frame, so it must not take a place under ``max_candidates`` nor
   suppress a box that is in the frame (a box in the padding may overlap one that
   reaches into the picture by more than ``iou``). Without a geometry nothing is
   dropped here.
5. **Order and cap.** Candidates are sorted by score, highest first, ties broken by
   the lower candidate index. Only the first ``max_candidates`` go on: past the cap the
   best by score are kept, the rest dropped (never an error).
6. **NMS.** ``area = (x2 - x1) * (y2 - y1)``; for boxes i, j:
   ``inter = max(min(x2i, x2j) - max(x1i, x1j), 0) * max(min(y2i, y2j) - max(y1i, y1j),
   0)``, ``IoU = inter / ((area_i + area_j) - inter)`` (the ``+0`` convention: no
   ``+1`` on widths, as torchvision). Candidate j after i is suppressed by i when both
   have the same class (any class with ``class_agnostic``) and ``IoU > iou``, the
   float32 IoU compared with ``iou`` as a double, as torchvision does (a NaN IoU,
   from a degenerate pair, suppresses nothing). Greedy in sorted order: a candidate not
   suppressed by an earlier kept one is kept, until ``max_det`` are kept.
7. **Frame.** With a geometry (``ImagePreprocess``), each kept box is mapped into the
   frame and clipped: ``x = (x - left) / scale_x`` and ``y = (y - top) / scale_y``
   (left, top, scale_x, scale_y as float32), then clamped to [0, frame width] and
   [0, frame height]. Without one the boxes stay in model-input pixels, unclipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = [
    "Candidates",
    "Cells",
    "HeadLayout",
    "decode_cells",
    "exp32",
    "frame_boxes",
    "gather",
    "inside_frame",
    "select",
    "sigmoid32",
]

F32 = np.float32
_Array = npt.NDArray[Any]

# Step 1's constants (Cephes expf); the kernels' source prints them as float32 bits.
CLAMP = F32(86.0)
LOG2E = F32(1.44269504088896341)
LN2_HI = F32(0.693359375)
LN2_LO = F32(-2.12194440e-4)
POLY = tuple(
    F32(c)
    for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
              1.6666665459e-1, 5.0000001201e-1)
)  # fmt: skip
_ONE, _HALF, _TWO = F32(1.0), F32(0.5), F32(2.0)
_ROWS = 256  # suppression rows the numpy NMS builds at once


def exp32(x: _Array) -> _Array:
    """Step 1's exp of a float32 array (a new array)."""
    x = np.asarray(x, F32)
    nan = np.isnan(x)
    x = np.clip(x, -CLAMP, CLAMP)
    n = np.rint(x * LOG2E)
    if nan.any():
        n[nan] = 0  # NaN stays NaN through r; n only scales
    r = (x - n * LN2_HI) - n * LN2_LO
    p = POLY[0]
    for c in POLY[1:]:
        p = p * r + c
    y = (p * (r * r) + r) + _ONE
    scale = ((n.astype(np.int32) + 127) << 23).view(F32)
    return np.asarray(y * scale, F32)


def sigmoid32(x: _Array) -> _Array:
    """Step 1's sigmoid: ``1 / (1 + exp32(-x))``."""
    return np.asarray(_ONE / (_ONE + exp32(-np.asarray(x, F32))), F32)


class HeadLayout(NamedTuple):
    """One head as the definition reads it (:class:`aiodla.Detect` plans these at open)."""

    kind: str  # "yolov5", "yolov8", "yolox" or "boxes" (yolov7 and yolo11 are aliases)
    height: int
    width: int
    stride: float
    anchors: tuple[tuple[float, float], ...]  # (w, h) per anchor; one (0, 0) if anchor-free
    offset: int  # candidate index of this head's first cell
    classes: int
    reg_max: int
    # "boxes" only (read as 1 x N): a candidate's values are a row of the logical array
    # in C order (N x (4 + classes)), not a column ((4 + classes) x N)
    rows: bool = False

    @property
    def cells(self) -> int:
        return len(self.anchors) * self.height * self.width


class Candidates(NamedTuple):
    """Cells that passed the threshold, in candidate-index order."""

    boxes: _Array  # (n, 4) float32, x1 y1 x2 y2 in model-input pixels
    scores: _Array  # (n,) float32
    classes: _Array  # (n,) int32
    ids: _Array  # (n,) int64, the candidate index
    not_finite: int = 0  # cells that passed but had a score or coordinate not finite
    outside: int = 0  # candidates dropped with nothing inside the frame

    @classmethod
    def empty(cls) -> Candidates:
        return cls(
            np.empty((0, 4), F32), np.empty(0, F32), np.empty(0, np.int32), np.empty(0, np.int64)
        )


def _prefilter(conf: float) -> float:
    """A logit below which no sigmoid32 passes ``conf``: logit(conf * 0.999), far
    outside sigmoid32's error (a few ulp), so the exact test decides every cell that
    matters. -inf when conf <= 0."""
    if conf <= 0:
        return -math.inf
    bound = conf * 0.999
    return math.log(bound / (1 - bound))


def _best_class(values: _Array) -> tuple[_Array, _Array]:
    """Step 3's class (first largest, NaN as -inf) and its value, per row of (n, C)."""
    clean = np.where(np.isnan(values), F32(-np.inf), values)
    best = np.argmax(clean, axis=1)
    return best.astype(np.int32), np.take_along_axis(clean, best[:, None], 1)[:, 0]


class Cells(NamedTuple):
    """Cells of one or more heads that may pass, with what decoding them needs."""

    t: _Array  # (n, channels of one anchor) float32
    gx: _Array  # (n,) float32 grid column, row
    gy: _Array
    stride: _Array  # (n,) float32
    aw: _Array  # (n,) float32 anchor size (yolov5; zeros else)
    ah: _Array
    ids: _Array  # (n,) int64 candidate index


def above(values: _Array, bound: Any) -> _Array:
    """``values > bound`` (bound a float32), exactly; float16 values compared as integers,
    numpy's float16 comparison being several times slower: the bits of a float16, with
    the magnitude bits flipped for negatives, order as the values do, and ``t > bound``
    is ``t >= h`` for h the least float16 above bound. (A NaN may pass; every later
    test drops it.)"""
    if values.dtype != np.float16:
        return np.asarray(values > bound)
    with np.errstate(over="ignore"):
        least = np.float16(bound)
        if not float(least) > float(bound):
            least = np.nextafter(least, np.float16(np.inf))
    if not float(least) > float(bound):  # bound >= inf: nothing is above it
        return np.zeros(values.shape, bool)
    bits = values.view(np.int16)
    key = bits ^ ((bits >> 15) & np.int16(0x7FFF))
    edge = np.array([least], np.float16).view(np.int16)
    return np.asarray(key >= (edge ^ ((edge >> 15) & np.int16(0x7FFF)))[0])


def gather(layout: HeadLayout, head: _Array, conf: float) -> Cells | None:
    """Step 2 for one head's logical array ``(1, channels, H, W)`` (any float dtype; a
    ``"boxes"`` output of any shape holding its N candidates, ``layout`` 1 x N): the
    cells a cheap necessary condition on one channel lets through (see
    ``_prefilter``), their channels as float32; None when there is none."""
    kind, hh, ww = layout.kind, layout.height, layout.width
    anchors = len(layout.anchors)
    if layout.rows:  # (N, 4 + classes) read as (4 + classes, N): a view, no copy
        values = np.asarray(head).reshape(hh * ww, -1).T
    else:
        values = np.asarray(head).reshape(-1, hh * ww)  # (channels, cells of one anchor)
    per = values.shape[0] // anchors
    f_conf = F32(conf)
    if kind in ("yolov5", "yolox"):
        bound = F32(_prefilter(conf)) if kind == "yolov5" else f_conf
        a_idx, cell = np.nonzero(above(values[4::per], bound))  # (anchors, H*W)
    else:
        first = 4 * layout.reg_max if kind == "yolov8" else 4
        classes = values[first : first + layout.classes]
        top = np.fmax.reduce(classes, axis=0)
        bound = F32(_prefilter(conf)) if kind == "yolov8" else f_conf
        cell = np.flatnonzero(top > bound)
        a_idx = np.zeros_like(cell)
    if not len(cell):
        return None
    rows = (a_idx * per)[:, None] + np.arange(per)[None, :]
    t = values[rows, cell[:, None]].astype(F32)  # (n, per): the cells' channels
    y, x = cell // ww, cell % ww
    sizes = np.array(layout.anchors, F32)[a_idx]
    ids = layout.offset + (a_idx.astype(np.int64) * hh + y) * ww + x
    stride = np.full(len(cell), layout.stride, F32)
    return Cells(t, x.astype(F32), y.astype(F32), stride, sizes[:, 0], sizes[:, 1], ids)


def decode_cells(kind: str, reg_max: int, cells: Cells, conf: float) -> Candidates:
    """Steps 3-4 for gathered cells (of any heads of one kind), in their order."""
    t, gx, gy, stride = cells.t, cells.gx, cells.gy, cells.stride
    if kind == "yolov5":
        cls, best = _best_class(t[:, 5:])
        s = sigmoid32(np.column_stack([t[:, :5], best]))  # one pass for six channels
        score = s[:, 4] * s[:, 5]
        cx = ((s[:, 0] * _TWO - _HALF) + gx) * stride
        cy = ((s[:, 1] * _TWO - _HALF) + gy) * stride
        w = ((s[:, 2] * _TWO) * (s[:, 2] * _TWO)) * cells.aw
        h = ((s[:, 3] * _TWO) * (s[:, 3] * _TWO)) * cells.ah
        box = _corners(cx, cy, w, h)
    elif kind == "yolox":
        cls, best = _best_class(t[:, 5:])
        score = t[:, 4] * best
        cx, cy = (t[:, 0] + gx) * stride, (t[:, 1] + gy) * stride
        wh = exp32(t[:, 2:4]) * stride[:, None]
        box = _corners(cx, cy, wh[:, 0], wh[:, 1])
    elif kind == "yolov8":
        cls, best = _best_class(t[:, 4 * reg_max :])
        score = sigmoid32(best)
        d = _distances(t[:, : 4 * reg_max].reshape(-1, 4, reg_max))
        ax, ay = gx + _HALF, gy + _HALF
        box = np.stack(
            [(ax - d[:, 0]) * stride, (ay - d[:, 1]) * stride,
             (ax + d[:, 2]) * stride, (ay + d[:, 3]) * stride], axis=1,
        )  # fmt: skip
    else:
        cls, best = _best_class(t[:, 4:])
        score = best
        box = _corners(t[:, 0], t[:, 1], t[:, 2], t[:, 3])
    score = np.asarray(score, F32)
    passed = score > F32(conf)
    finite = np.isfinite(box).all(axis=1) & np.isfinite(score)
    keep = passed & finite
    return Candidates(
        np.ascontiguousarray(box[keep], F32),
        score[keep],
        cls[keep],
        cells.ids[keep],
        int(np.count_nonzero(passed & ~finite)),
    )


def _corners(cx: _Array, cy: _Array, w: _Array, h: _Array) -> _Array:
    hw, hh = w * _HALF, h * _HALF
    return np.stack([cx - hw, cy - hh, cx + hw, cy + hh], axis=1).astype(F32)


def _distances(bins: _Array) -> _Array:
    """Step 4's softmax-DFL, (n, 4, reg_max) -> (n, 4), sums in order of j."""
    e = exp32(bins - np.max(bins, axis=2, keepdims=True))
    weights = np.arange(bins.shape[2], dtype=F32)
    total = np.zeros(bins.shape[:2], F32)
    moment = np.zeros(bins.shape[:2], F32)
    for j in range(bins.shape[2]):  # over bins (a constant), not over candidates
        total = total + e[:, :, j]
        moment = moment + e[:, :, j] * weights[j]
    return np.asarray(moment / total, F32)


def merge(parts: Sequence[Cells | None]) -> Cells | None:
    """The gathered cells of several heads, in candidate-index order (heads in stride
    order): one decoding pass then serves them all."""
    found = [part for part in parts if part is not None]
    if len(found) < 2:
        return found[0] if found else None
    return Cells(*(np.concatenate(field) for field in zip(*found, strict=True)))


def iou_threshold32(iou: float) -> np.float32:
    """The float32 ``t`` with ``x > t`` exactly when ``float(x) > iou`` for every float32
    ``x``: ``iou`` rounded down to float32. torchvision compares its float32 IoU with
    the threshold as a double; ``iou=0.4`` rounded to nearest (0.40000001) would keep a
    box whose IoU is exactly that float, which torchvision suppresses."""
    nearest: np.float32 = np.float32(iou)
    if float(nearest) <= iou:
        return nearest
    below: np.float32 = np.nextafter(nearest, np.float32(-np.inf))
    return below


def select(
    found: Candidates,
    *,
    iou: float,
    max_det: int,
    max_candidates: int,
    class_agnostic: bool,
) -> _Array:
    """Steps 5 and 6: the positions in ``found`` that survive, best score first.

    The suppressions are a mask over the sorted candidates (a row of flags per
    candidate, as torchvision's CUDA NMS and the kernel build it as bits), built a
    block of rows at a time as the greedy pass reaches them: that pass loops over kept
    boxes only, ORing each one's row into the removed set, and stops at ``max_det``.
    """
    n_all = len(found.scores)
    if not n_all:
        return np.empty(0, np.int64)
    # lexsort's last key is the primary one: score descending, then candidate index
    order = np.lexsort((found.ids, -found.scores))[:max_candidates]
    boxes = found.boxes[order]
    n = len(order)
    classes = None if class_agnostic else found.classes[order]
    x1, y1, x2, y2 = boxes.T
    with np.errstate(over="ignore"):  # see rows()
        area = (x2 - x1) * (y2 - y1)
    threshold = iou_threshold32(iou)

    def rows(r0: int, r1: int) -> _Array:
        """Suppression flags of candidates r0..r1 over every candidate (only later ones
        can be set)."""
        i, j = slice(r0, r1), slice(r0, n)
        # boxes of 1e20 pixels overflow to inf and their IoU is NaN (suppressing
        # nothing), as on the kernels: no warning
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            iw = np.minimum(x2[i, None], x2[j]) - np.maximum(x1[i, None], x1[j])
            ih = np.minimum(y2[i, None], y2[j]) - np.maximum(y1[i, None], y1[j])
            inter = np.maximum(iw, F32(0)) * np.maximum(ih, F32(0))
            overlap = inter / ((area[i, None] + area[j]) - inter) > threshold
        if classes is not None:
            overlap &= classes[i, None] == classes[j]
        overlap &= np.arange(r0, n) > np.arange(r0, r1)[:, None]  # only later ones
        flags = np.zeros((r1 - r0, n), bool)
        flags[:, r0:] = overlap
        return flags

    removed = np.zeros(n, bool)
    kept: list[int] = []
    start, mask = 0, rows(0, min(_ROWS, n))
    i = 0
    while len(kept) < max_det:
        if i >= start + len(mask):  # the mask is built a block of rows at a time, as needed
            start, mask = i, rows(i, min(i + _ROWS, n))
        kept.append(i)
        removed |= mask[i - start]
        # the next candidate after i that no kept box suppressed
        step = int(np.argmin(removed[i + 1 :])) if i + 1 < n else 0
        if i + 1 >= n or removed[i + 1 + step]:
            break
        i += 1 + step
    return np.asarray(order[kept], np.int64)


def inside_frame(
    found: Candidates,
    top: int,
    left: int,
    scale_y: float,
    scale_x: float,
    height: int,
    width: int,
) -> Candidates:
    """Step 4's last rule: the candidates whose box keeps an area inside a ``height`` x
    ``width`` frame once mapped and clipped (step 7), the others counted in ``outside``."""
    mapped = frame_boxes(found.boxes, top, left, scale_y, scale_x, height, width)
    keep = (mapped[:, 2] > mapped[:, 0]) & (mapped[:, 3] > mapped[:, 1])
    dropped = len(keep) - int(np.count_nonzero(keep))
    if not dropped:
        return found
    return Candidates(
        found.boxes[keep],
        found.scores[keep],
        found.classes[keep],
        found.ids[keep],
        found.not_finite,
        dropped,
    )


def frame_boxes(
    boxes: _Array, top: int, left: int, scale_y: float, scale_x: float, height: int, width: int
) -> _Array:
    """Step 7: model-input boxes (n, 4) into a ``height`` x ``width`` frame, clipped."""
    out = np.empty_like(boxes, F32)
    out[:, 0::2] = (boxes[:, 0::2] - F32(left)) / F32(scale_x)
    out[:, 1::2] = (boxes[:, 1::2] - F32(top)) / F32(scale_y)
    # as the kernel's comparisons: a NaN stays NaN (np.clip would too)
    out[:, 0::2] = np.clip(out[:, 0::2], F32(0), F32(width))
    out[:, 1::2] = np.clip(out[:, 1::2], F32(0), F32(height))
    return out
