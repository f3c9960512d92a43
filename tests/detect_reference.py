"""A plain reference of :mod:`aiodla._detect_math`'s definition: one loop iteration per
cell and per candidate, scalar float32 arithmetic, each step as the docstring writes
it. Slow and obviously correct; the tests hold the vectorized numpy path and the
kernels' host build to it on small heads, and make heads for them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from aiodla._detect import Detect, DetectPlan
from aiodla._tensors import TensorSpec

F = np.float32
CEPHES = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
          1.6666665459e-1, 5.0000001201e-1)  # fmt: skip


def exp32(x: Any) -> Any:
    x = F(x)
    if math.isnan(x):
        return x
    x = min(max(x, F(-86.0)), F(86.0))
    n = F(np.rint(x * F(1.44269504088896341)))
    r = (x - n * F(0.693359375)) - n * F(-2.12194440e-4)
    p = F(CEPHES[0])
    for c in CEPHES[1:]:
        p = p * r + F(c)
    y = (p * (r * r) + r) + F(1)
    return F(y * F(2.0 ** int(n)))


def sigmoid32(x: Any) -> Any:
    return F(F(1) / (F(1) + exp32(-F(x))))


def best_class(values: list[Any]) -> tuple[int, Any]:
    best, value = 0, F(-np.inf)
    for c, v in enumerate(values):
        if v > value:  # NaN never wins; the first of equal values does
            best, value = c, v
    return best, value


Frame = tuple[Any, int, int]  # a geometry, the frame's height and width


def decode(
    plan: DetectPlan,
    heads: list[Any],
    frame: Frame | None = None,
    dropped: dict[str, int] | None = None,
) -> list[tuple[int, Any, Any, int]]:
    """Candidates as (index, box, score, class), cell by cell; with a ``frame``, without
    the boxes that have nothing inside it. ``dropped`` counts what step 4 dropped."""
    counts = {"outside": 0, "not_finite": 0} if dropped is None else dropped
    counts.setdefault("outside", 0)
    counts.setdefault("not_finite", 0)
    conf = F(plan.detect.conf)
    out = []
    for layout, head in zip(plan.layouts, heads):
        t_all = np.asarray(head, F)[0]
        if layout.kind == "boxes":  # read as (4 + classes) x 1 x N, by its layout
            per = 4 + layout.classes
            matrix = t_all.reshape(-1, per).T if layout.rows else t_all.reshape(per, -1)
            t_all = matrix[:, None, :]
        per = t_all.shape[0] // len(layout.anchors)
        stride = F(layout.stride)
        for a, (aw, ah) in enumerate(layout.anchors):
            for y in range(layout.height):
                for x in range(layout.width):
                    t = [F(v) for v in t_all[a * per : (a + 1) * per, y, x]]
                    gx, gy = F(x), F(y)
                    kind = layout.kind
                    if kind == "yolov5":
                        c, v = best_class(t[5:])
                        score = F(sigmoid32(t[4]) * sigmoid32(v))
                        s = [sigmoid32(v) for v in t[:4]]
                        cx = ((s[0] * F(2) - F(0.5)) + gx) * stride
                        cy = ((s[1] * F(2) - F(0.5)) + gy) * stride
                        w = ((s[2] * F(2)) * (s[2] * F(2))) * F(aw)
                        h = ((s[3] * F(2)) * (s[3] * F(2))) * F(ah)
                        box = [cx - w * F(0.5), cy - h * F(0.5), cx + w * F(0.5), cy + h * F(0.5)]
                    elif kind == "yolox":
                        c, v = best_class(t[5:])
                        score = F(t[4] * v)
                        cx, cy = (t[0] + gx) * stride, (t[1] + gy) * stride
                        w, h = exp32(t[2]) * stride, exp32(t[3]) * stride
                        box = [cx - w * F(0.5), cy - h * F(0.5), cx + w * F(0.5), cy + h * F(0.5)]
                    elif kind == "yolov8":
                        reg = layout.reg_max
                        c, v = best_class(t[4 * reg :])
                        score = sigmoid32(v)
                        d = []
                        for k in range(4):
                            bins = t[k * reg : (k + 1) * reg]
                            m = max(bins)
                            total, moment = F(0), F(0)
                            for j, b in enumerate(bins):
                                e = exp32(b - m)
                                total = total + e
                                moment = moment + e * F(j)
                            d.append(F(moment / total))
                        ax, ay = gx + F(0.5), gy + F(0.5)
                        box = [(ax - d[0]) * stride, (ay - d[1]) * stride,
                               (ax + d[2]) * stride, (ay + d[3]) * stride]  # fmt: skip
                    else:
                        c, v = best_class(t[4:])
                        score = v
                        box = [t[0] - t[2] * F(0.5), t[1] - t[3] * F(0.5),
                               t[0] + t[2] * F(0.5), t[1] + t[3] * F(0.5)]  # fmt: skip
                    objectness = t[4] if kind == "yolox" else sigmoid32(t[4])
                    if kind in ("yolov5", "yolox") and not objectness > conf:
                        continue
                    if not score > conf:
                        continue
                    if not (math.isfinite(score) and all(math.isfinite(b) for b in box)):
                        counts["not_finite"] += 1
                        continue
                    if frame is not None:
                        x1, y1, x2, y2 = to_frame(box, *frame)
                        if not (x2 > x1 and y2 > y1):
                            counts["outside"] += 1
                            continue
                    index = layout.offset + (a * layout.height + y) * layout.width + x
                    out.append((index, [F(b) for b in box], F(score), c))
    return out


def iou(a: list[Any], b: list[Any]) -> Any:
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    iw = max(min(a[2], b[2]) - max(a[0], b[0]), F(0))
    ih = max(min(a[3], b[3]) - max(a[1], b[1]), F(0))
    inter = iw * ih
    with np.errstate(invalid="ignore", divide="ignore"):
        return F(inter / ((area_a + area_b) - inter))


def run(
    plan: DetectPlan,
    heads: list[Any],
    frame: Frame | None = None,
    dropped: dict[str, int] | None = None,
) -> list[tuple[int, Any, Any, int]]:
    """Kept candidates, in order (boxes in model-input pixels): sort, cap, then greedy
    NMS, one pair at a time; with a ``frame``, of the boxes with something inside it."""
    detect = plan.detect
    found = decode(plan, heads, frame, dropped)
    found = sorted(found, key=lambda c: (-c[2], c[0]))[: detect.max_candidates]
    kept: list[tuple[int, Any, Any, int]] = []
    for candidate in found:
        if len(kept) == detect.max_det:
            break
        if not any(
            (detect.class_agnostic or k[3] == candidate[3])
            and float(iou(k[1], candidate[1])) > detect.iou  # as a double, as torchvision
            for k in kept
        ):
            kept.append(candidate)
    return kept


def to_frame(box: list[Any], geometry: Any, height: int, width: int) -> list[Any]:
    x = [(box[i] - F(geometry.left)) / F(geometry.scale_x) for i in (0, 2)]
    y = [(box[i] - F(geometry.top)) / F(geometry.scale_y) for i in (1, 3)]
    x = [min(max(v, F(0)), F(width)) for v in x]
    y = [min(max(v, F(0)), F(height)) for v in y]
    return [F(x[0]), F(y[0]), F(x[1]), F(y[1])]


# -- heads to test with --------------------------------------------------------------------


def plan_for(
    detect: Detect,
    size: tuple[int, int] = (64, 96),
    dtype: str = "float32",
    boxes: tuple[int, int, int, int] | None = None,
) -> DetectPlan:
    """The plan of ``detect`` over outputs shaped as its heads need, for a ``size`` input;
    a ``"boxes"`` output is ``boxes`` if given, else (1, 4 + classes, 1, 150)."""
    if detect.kind == "boxes":
        shape = boxes or (1, detect.channels(), 1, 150)
        specs = [TensorSpec("boxes", shape, dtype, "nchw")]
    else:
        specs = []
        for k, stride in enumerate(detect.strides or ()):
            anchors = len((detect.anchors or ((0, 0),) * 8)[k]) // 2
            channels = detect.channels(anchors)
            specs.append(
                TensorSpec(
                    f"p{stride}", (1, channels, size[0] // stride, size[1] // stride), dtype, "nchw"
                )
            )
    return detect.plan(size, specs[::-1])  # outputs in another order than the strides


def heads_for(plan: DetectPlan, rng: np.random.Generator, *, ties: bool) -> list[Any]:
    """Random heads that give many candidates: with ``ties``, values from a small set, so
    that scores tie and boxes coincide; else continuous values."""
    heads = []
    detect = plan.detect
    for spec, layout in zip(plan.specs, plan.layouts):
        shape = spec.shape
        if ties:
            values = rng.choice(np.array([-1.0, 0.0, 0.5, 1.0, 2.0], F), size=shape)
        else:
            values = rng.normal(0.0, 1.5, size=shape).astype(F)
        if layout.kind == "yolox":  # probabilities and small box offsets
            per = shape[1]
            values[:, 4:per] = 1 / (1 + np.exp(-values[:, 4:per]))
            values[:, 2:4] += 1.5  # boxes wider than the grid: they overlap
        if layout.kind == "boxes":
            n = layout.cells
            matrix = np.empty((4 + layout.classes, n), F)
            matrix[:2] = rng.choice(np.arange(0, 96, 4.0), size=(2, n))
            matrix[2:4] = rng.choice(np.array([8.0, 12.0, 16.0, 24.0]), size=(2, n))
            matrix[4:] = rng.choice(np.array([0.1, 0.3, 0.6, 0.9], F), size=(layout.classes, n))
            values = boxes_head(layout, matrix, shape)
        if detect.kind == "yolov5":
            values[:, 4 :: 5 + detect.classes] += 1.0  # more cells past the objectness test
        heads.append(values.astype(spec.numpy_dtype))
    return heads


def cap_heads(plan: DetectPlan, rng: np.random.Generator) -> tuple[list[Any], list[Any]]:
    """Heads of a ``"boxes"`` plan where the cap of step 5 changes what is kept, and
    what must be kept, worked out from the values themselves.

    Scores, given to the cells in a random order: 30 distinct ones, then 20 equal ones,
    then 40 distinct lower ones, the rest below ``conf``; a cap of 25 cuts among
    distinct scores, one of 40 inside the tie (where the lower indices go on). Boxes
    are 10 x 10 and apart (``[16 n + 3, 3, 16 n + 13, 13]`` for candidate n), except
    that the candidates ranked 3, 7, 11, 15 and 19 copy the box and class of the one
    ranked just above: NMS suppresses those five, so with ``max_det`` at the cap
    fewer than ``max_det`` boxes are kept, where without the cap the candidates past
    it would fill the gap. Every value is exact in float16.

    Returns the heads and the candidates that pass ``conf`` as (index, box, score,
    class), best first (score, then index), each with whether it is a copy."""
    (spec,) = plan.specs
    (layout,) = plan.layouts
    cells, classes = layout.cells, layout.classes
    assert cells >= 100 and plan.detect.conf < 300 / 1024
    levels = [(900 - 4 * k) / 1024 for k in range(30)] + [600 / 1024] * 20
    levels += [(500 - 4 * k) / 1024 for k in range(40)]
    levels += [100 / 1024] * (cells - len(levels))  # below conf: no candidate
    scores = np.array(levels, F)[rng.permutation(cells)]
    best = rng.integers(0, classes, cells)
    left = (16 * np.arange(cells) + 3).astype(F)
    ranked = sorted(range(cells), key=lambda n: (-scores[n], n))
    copies = {ranked[r]: ranked[r - 1] for r in (3, 7, 11, 15, 19)}
    for copy, original in copies.items():
        left[copy], best[copy] = left[original], best[original]
    values = np.zeros((4 + classes, cells), F)
    values[0] = left + 5  # cx
    values[1] = 8  # cy
    values[2:4] = 10  # w, h
    values[4:] = 50 / 1024  # the other classes: far below every score
    values[4 + best, np.arange(cells)] = scores
    found = [
        (n, [left[n], F(3), left[n] + F(10), F(13)], scores[n], int(best[n]), n in copies)
        for n in ranked
        if scores[n] > F(plan.detect.conf)
    ]
    return [boxes_head(layout, values, spec.shape).astype(spec.numpy_dtype)], found


def boxes_head(layout: Any, matrix: Any, shape: tuple[int, ...]) -> Any:
    """A ``"boxes"`` output of ``shape`` holding the (4 + classes) x N ``matrix`` (one
    column a candidate) in the layout the plan reads."""
    return (matrix.T if layout.rows else matrix).reshape(shape)
