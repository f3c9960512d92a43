"""Small detector graphs built in code, each ending in the decode tail its exporter writes.

Every builder returns the serialized ONNX model of a tiny network: a convolutional
"backbone" with a feature pyramid (SiLU activations, a nearest-neighbour upsample and a
channel concatenation, as the real ones have) over a 1x3x64x64 input, three heads at
strides 8, 16 and 32, and then the exporter's tail, op for op. The weights are drawn
from a fixed seed; the head biases are set so that a fair share of cells passes a 0.25
score threshold and the scores spread out (no near-ties for NMS to break).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SIZE = 64
STRIDES = (8, 16, 32)
CLASSES = 2
WIDTH = 8  # channels of the backbone
# Anchors of the YOLOv5 test graphs (w, h pairs per stride), in input pixels: not the
# defaults, so that the compiler has to read them from the graph.
ANCHORS = ((4, 5, 8, 10, 12, 9), (10, 20, 20, 15, 19, 40), (40, 30, 50, 60, 60, 50))


class _Builder:
    def __init__(self, seed: int, opset: int) -> None:
        self.opset = opset
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def const(self, value: Any, stem: str = "c", dtype: Any = np.float32) -> str:
        name = self.name(stem)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: int = 1, **attrs: Any) -> Any:
        names = [self.name(op.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, name=self.name(op), **attrs))
        return names[0] if outputs == 1 else names

    def conv(
        self,
        x: str,
        cin: int,
        cout: int,
        k: int = 3,
        s: int = 1,
        *,
        bias: Any = None,
        group: int = 1,
        gain: float = 1.0,
    ) -> str:
        fan = cin // group * k * k
        w = self.rng.standard_normal((cout, cin // group, k, k)) * gain / np.sqrt(fan)
        b = self.rng.standard_normal(cout) * 0.1 if bias is None else bias
        return self.node(
            "Conv",
            [x, self.const(w, "w"), self.const(b, "b")],
            kernel_shape=[k, k],
            strides=[s, s],
            pads=[k // 2] * 4,
            group=group,
        )

    def split(self, x: str, sizes: list[int], axis: int) -> Any:
        """Split: sizes as an attribute before opset 13, as an input from it."""
        if self.opset < 13:
            return self.node("Split", [x], outputs=len(sizes), axis=axis, split=sizes)
        return self.node("Split", [x, self.const(sizes, "split", np.int64)], len(sizes), axis=axis)

    def silu(self, x: str) -> str:
        return self.node("Mul", [x, self.node("Sigmoid", [x])])

    def backbone(self, image: str) -> list[str]:
        """P3, P4, P5 (strides 8, 16, 32) of a 64x64 image, WIDTH channels each."""
        x = self.silu(self.conv(image, 3, WIDTH, s=2, gain=1.5))  # 32
        x = self.silu(self.conv(x, WIDTH, WIDTH, s=2, gain=1.5))  # 16
        p3 = self.silu(self.conv(x, WIDTH, WIDTH, s=2, gain=1.5))  # 8
        p4 = self.silu(self.conv(p3, WIDTH, WIDTH, s=2, gain=1.5))  # 4
        p5 = self.silu(self.conv(p4, WIDTH, WIDTH, s=2, gain=1.5))  # 2
        up = self.node(
            "Resize",
            [p5, self.const([], "roi"), self.const([1, 1, 2, 2], "scales")],
            mode="nearest",
            coordinate_transformation_mode="asymmetric",
            nearest_mode="floor",
        )
        p4 = self.silu(self.conv(self.node("Concat", [p4, up], axis=1), 2 * WIDTH, WIDTH, k=1))
        return [p3, p4, p5]

    def model(self, output: str, output_shape: list[int]) -> bytes:
        graph = helper.make_graph(
            self.nodes,
            "detector",
            [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, output_shape)],
            initializer=self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        model = onnx.shape_inference.infer_shapes(model)
        onnx.checker.check_model(model, full_check=True)
        return bytes(model.SerializeToString())

    def rename_output(self, tensor: str, name: str) -> None:
        for node in self.nodes:
            node.output[:] = [name if o == tensor else o for o in node.output]


def _grids(stride: int) -> tuple[int, np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    n = SIZE // stride
    yv, xv = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    return n, xv, yv


def yolov5(seed: int = 5) -> bytes:
    """Ultralytics YOLOv5 v7.0 ``export.py --include onnx`` (opset 12, static shape):
    per scale the head's 1x1 Conv, Reshape to (1, na, no, ny, nx), Transpose
    (0, 1, 3, 4, 2), Sigmoid, Split (2, 2, nc + 1) on the last axis, ``xy = (xy * 2 +
    grid) * stride`` with the grid constant holding ``grid - 0.5``, ``wh = (wh * 2) ** 2
    * anchor_grid``, Concat, Reshape to (1, na * ny * nx, no); the scales concatenated
    into ``output0`` (1, N, 5 + nc): cx, cy, w, h, objectness, class probabilities."""
    b = _Builder(seed, 12)
    na, no = 3, 5 + CLASSES
    rows = []
    for k, (p, stride) in enumerate(zip(b.backbone("images"), STRIDES)):
        bias = b.rng.standard_normal(na * no) * 0.5
        bias[4::no] -= 2.0  # objectness
        head = b.conv(p, WIDTH, na * no, k=1, bias=bias, gain=3.0)
        n, xv, yv = _grids(stride)
        x = b.node("Reshape", [head, b.const([1, na, no, n, n], "shape", np.int64)])
        x = b.node("Transpose", [x], perm=[0, 1, 3, 4, 2])
        x = b.node("Sigmoid", [x])
        xy, wh, conf = b.split(x, [2, 2, no - 4], axis=4)
        grid = np.broadcast_to(np.stack([xv, yv], -1)[None, None], (1, na, n, n, 2)) - 0.5
        xy = b.node("Mul", [xy, b.const(2.0)])
        xy = b.node("Mul", [b.node("Add", [xy, b.const(grid, "grid")]), b.const(float(stride))])
        anchors = np.array(ANCHORS[k], np.float32).reshape(1, na, 1, 1, 2)
        anchor_grid = np.broadcast_to(anchors, (1, na, n, n, 2))
        wh = b.node("Pow", [b.node("Mul", [wh, b.const(2.0)]), b.const(2.0)])
        wh = b.node("Mul", [wh, b.const(anchor_grid, "anchor_grid")])
        y = b.node("Concat", [xy, wh, conf], axis=4)
        rows.append(b.node("Reshape", [y, b.const([1, na * n * n, no], "shape", np.int64)]))
    out = b.node("Concat", rows, axis=1)
    b.rename_output(out, "output0")
    total = na * sum((SIZE // s) ** 2 for s in STRIDES)
    return b.model("output0", [1, total, no])


def yolov8(seed: int = 8, *, variant: str = "yolov8") -> bytes:
    """Ultralytics 8.3 ``YOLO(...).export(format="onnx")`` (opset 19, static shape) of a
    YOLOv8 (``variant="yolov8"``), YOLO11 (``"yolo11"``: the class branch's depthwise
    convolutions) or YOLOv5u (``"yolov5u"``: YOLOv5's backbone, the same anchor-free
    Detect head) model: per scale the box branch (4 * 16 DFL bins) and class branch
    concatenated on channels, Reshape to (1, no, -1); the scales concatenated on the
    last axis, Split (64, nc), the DFL (Reshape (1, 4, 16, N), Transpose (0, 2, 1, 3),
    Softmax on axis 1, the 1x1 Conv of weights 0..15, Reshape (1, 4, N)), dist2bbox
    (Split in two, ``x1y1 = anchors - lt``, ``x2y2 = anchors + rb``, centre ``(x1y1 +
    x2y2) / 2``, size ``x2y2 - x1y1``), times the strides, then Concat with the class
    Sigmoid into ``output0`` (1, 4 + nc, N): cx, cy, w, h, class probabilities."""
    b = _Builder(seed, 19)
    reg_max, no = 16, 64 + CLASSES
    columns, anchors, strides = [], [], []
    for p, stride in zip(b.backbone("images"), STRIDES):
        box = b.silu(b.conv(p, WIDTH, WIDTH))
        box = b.conv(box, WIDTH, 4 * reg_max, k=1, gain=4.0)
        if variant == "yolo11":
            cls = b.silu(b.conv(p, WIDTH, WIDTH, group=WIDTH))
            cls = b.silu(b.conv(cls, WIDTH, WIDTH, k=1))
        else:
            cls = b.silu(b.conv(p, WIDTH, WIDTH))
        bias = b.rng.standard_normal(CLASSES) * 0.3 - 0.7
        cls = b.conv(cls, WIDTH, CLASSES, k=1, bias=bias, gain=5.0)
        head = b.node("Concat", [box, cls], axis=1)
        columns.append(b.node("Reshape", [head, b.const([1, no, -1], "shape", np.int64)]))
        n, xv, yv = _grids(stride)
        anchors.append(np.stack([xv.ravel(), yv.ravel()]) + 0.5)
        strides.append(np.full(n * n, stride))
    x = b.node("Concat", columns, axis=2)
    total = sum((SIZE // s) ** 2 for s in STRIDES)
    box, cls = b.split(x, [4 * reg_max, CLASSES], axis=1)
    d = b.node("Reshape", [box, b.const([1, 4, reg_max, total], "shape", np.int64)])
    d = b.node("Softmax", [b.node("Transpose", [d], perm=[0, 2, 1, 3])], axis=1)
    dfl = np.arange(reg_max, dtype=np.float32).reshape(1, reg_max, 1, 1)
    d = b.node("Conv", [d, b.const(dfl, "dfl")], kernel_shape=[1, 1])
    d = b.node("Reshape", [d, b.const([1, 4, total], "shape", np.int64)])
    lt, rb = b.split(d, [2, 2], axis=1)
    points = b.const(np.concatenate(anchors, 1)[None], "anchors")
    x1y1, x2y2 = b.node("Sub", [points, lt]), b.node("Add", [points, rb])
    centre = b.node("Div", [b.node("Add", [x1y1, x2y2]), b.const(2.0)])
    size = b.node("Sub", [x2y2, x1y1])
    dbox = b.node("Concat", [centre, size], axis=1)
    dbox = b.node("Mul", [dbox, b.const(np.concatenate(strides)[None], "strides")])
    out = b.node("Concat", [dbox, b.node("Sigmoid", [cls])], axis=1)
    b.rename_output(out, "output0")
    return b.model("output0", [1, 4 + CLASSES, total])


def yolox(seed: int = 10, *, simplified: bool = True) -> bytes:
    """Megvii YOLOX 0.3.0 ``tools/export_onnx.py`` (opset 11, ``decode_in_inference``):
    per scale the decoupled head's box (4), objectness (1, Sigmoid) and class (nc,
    Sigmoid) convolutions concatenated on channels, Reshape to (1, 5 + nc, -1); the
    scales concatenated on the last axis, Transpose (0, 2, 1); then ``decode_outputs``:
    Slices ``[..., 0:2]``, ``[..., 2:4]``, ``[..., 4:]``, ``(xy + grids) * strides``,
    ``exp(wh) * strides``, Concat into ``output`` (1, N, 5 + nc): cx, cy, w, h,
    objectness, class probabilities. ``simplified=False``: as exported without
    onnx-simplifier, each flatten's shape computed from the head's own ``Shape``
    (Shape, Slice, Concat with -1), as torch.onnx writes ``flatten(start_dim=2)``."""
    b = _Builder(seed, 11)
    no = 5 + CLASSES
    columns, grids, strides = [], [], []
    for p, stride in zip(b.backbone("images"), STRIDES):
        stem = b.silu(b.conv(p, WIDTH, WIDTH, k=1))
        reg = b.conv(b.silu(b.conv(stem, WIDTH, WIDTH)), WIDTH, 4, k=1, gain=0.5)
        obj = b.conv(stem, WIDTH, 1, k=1, bias=np.array([0.5]), gain=12.0)
        cls = b.conv(b.silu(b.conv(stem, WIDTH, WIDTH)), WIDTH, CLASSES, k=1, gain=12.0)
        head = b.node("Concat", [reg, b.node("Sigmoid", [obj]), b.node("Sigmoid", [cls])], axis=1)
        shape = b.const([1, no, -1], "shape", np.int64)
        if not simplified:
            leading = b.node(
                "Slice",
                [b.node("Shape", [head]), b.const([0], "s", np.int64), b.const([2], "e", np.int64)],
            )
            shape = b.node("Concat", [leading, b.const([-1], "rest", np.int64)], axis=0)
        columns.append(b.node("Reshape", [head, shape]))
        n, xv, yv = _grids(stride)
        grids.append(np.stack([xv.ravel(), yv.ravel()], 1))
        strides.append(np.full((n * n, 1), stride))
    x = b.node("Transpose", [b.node("Concat", columns, axis=2)], perm=[0, 2, 1])

    def part(start: int, end: int) -> str:
        return b.node(
            "Slice",
            [
                x,
                b.const([start], "s", np.int64),
                b.const([end], "e", np.int64),
                b.const([2], "a", np.int64),
            ],
        )

    stride = b.const(np.concatenate(strides)[None], "strides")
    xy = b.node("Mul", [b.node("Add", [part(0, 2), b.const(np.concatenate(grids)[None])]), stride])
    wh = b.node("Mul", [b.node("Exp", [part(2, 4)]), stride])
    out = b.node("Concat", [xy, wh, part(4, no)], axis=2)
    b.rename_output(out, "output")
    total = sum((SIZE // s) ** 2 for s in STRIDES)
    return b.model("output", [1, total, no])


FAMILIES = {
    "yolov5": yolov5,
    "yolov5u": lambda: yolov8(55, variant="yolov5u"),
    "yolov8": yolov8,
    "yolo11": lambda: yolov8(11, variant="yolo11"),
    "yolox": yolox,
    "yolox-unsimplified": lambda: yolox(simplified=False),
}
# The Detect head each family decodes as.
HEADS = {
    "yolov5": "yolov5",
    "yolov5u": "yolov8",
    "yolov8": "yolov8",
    "yolo11": "yolov8",
    "yolox": "yolox",
    "yolox-unsimplified": "yolox",
}


def images(count: int, seed: int = 0) -> list[np.ndarray[Any, Any]]:
    """Model inputs (1, 3, 64, 64) float32 in [0, 1]: random noise, then structured
    ones (a background with a few bright and dark rectangles, and a little noise),
    alternating."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        if i % 2 == 0:
            out.append(rng.random((1, 3, SIZE, SIZE), dtype=np.float32))
            continue
        image = np.full((1, 3, SIZE, SIZE), rng.random(), np.float32)
        for _ in range(3):
            y, x = rng.integers(0, SIZE - 8, 2)
            h, w = rng.integers(6, 30, 2)
            image[0, :, y : y + h, x : x + w] = rng.random((3, 1, 1))
        # a little sensor noise: flat regions would give cells of exactly equal scores,
        # whose order then rests on the last bit
        image += rng.normal(0, 0.02, image.shape).astype(np.float32)
        out.append(np.clip(image, 0, 1))
    return out
