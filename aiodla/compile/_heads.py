"""Where a detector's graph stops being a DLA network: its family, its raw per-scale head
outputs, and the cut there (NVIDIA's ONNX GraphSurgeon).

The cut point is found by walking back from the export's output through its decode
tail until each path reaches a four-dimensional ``(1, C, h, w)`` tensor that a Reshape
or Flatten reads: the per-scale head output that every family's exporter flattens
before decoding (YOLOv5 reshapes it to five dimensions, YOLOv8 and YOLOX to ``(1, C,
h * w)``). The tail's operations name the family (a Softmax: the DFL of YOLOv8-style
heads; an Exp: YOLOX; a Pow: YOLOv5's ``(2 * s) ** 2``), unless ``head=`` names it.

Nothing is taken on trust: the removed tail, run on onnxruntime for random head values,
must compute what :func:`._exporter.export_output` says that family computes, with the
strides, anchors, classes and ``reg_max`` read from the graph; YOLOv5's anchors and
strides are read by running the tail on zero logits (``sigmoid(0) * 2 == 1``: the
output's width and height are then the anchors, its centre ``stride / 2``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import ModelError
from ._exporter import export_output

__all__ = ["HEADS", "HeadCut", "find_heads", "tail_model", "trim"]

_Array = np.ndarray[Any, Any]

#: ``--head`` names: the Detect head each decodes as.
HEADS = {
    "yolov5": "yolov5",
    "yolov7": "yolov5",
    "yolov5u": "yolov8",
    "yolov8": "yolov8",
    "yolo11": "yolov8",
    "yolox": "yolox",
}
_FLATTENING = ("Reshape", "Flatten")


@dataclasses.dataclass(frozen=True)
class HeadCut:
    """A detector's heads: what the cut keeps and the Detect that replaces the tail."""

    family: str  # the Detect head: "yolov5", "yolov8" or "yolox"
    heads: tuple[str, ...]  # the head tensors, in stride order (their names in the graph)
    shapes: tuple[tuple[int, int, int, int], ...]
    strides: tuple[int, ...]
    classes: int
    input_name: str
    input_size: tuple[int, int]  # H, W
    output_name: str  # the export's own output
    anchors: tuple[tuple[float, ...], ...] | None = None
    reg_max: int = 16
    max_difference: float = 0.0  # the tail against the family's arithmetic

    @property
    def names(self) -> tuple[str, ...]:
        """The head outputs' names in the trimmed model."""
        return tuple(f"head_stride{s}" for s in self.strides)

    def detect_settings(self) -> dict[str, Any]:
        """The keywords of the :class:`aiodla.Detect` that replaces the tail."""
        settings: dict[str, Any] = {
            "head": self.family,
            "classes": self.classes,
            "strides": list(self.strides),
            "outputs": list(self.names),
        }
        if self.family == "yolov5":
            settings["anchors"] = [list(row) for row in self.anchors or ()]
        if self.family == "yolov8":
            settings["reg_max"] = self.reg_max
        return settings


def _gs() -> Any:
    try:
        import onnx_graphsurgeon
    except ImportError as exc:
        raise ModelError(
            "aiodla compile needs onnx-graphsurgeon: pip install 'aiodla[compile]'"
        ) from exc
    return onnx_graphsurgeon


def _import(model: Any) -> Any:
    """The model as a GraphSurgeon graph with its constant subgraphs folded: an export
    made without a simplifier computes its reshapes' shapes from ``Shape`` of the very
    tensors reshaped (torch's ``flatten``), which a static shape makes constant."""
    graph = _gs().import_onnx(model)
    graph.fold_constants().cleanup()
    return graph


def _shape(tensor: Any) -> tuple[int, ...] | None:
    shape = getattr(tensor, "shape", None)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)


def _is_grid(shape: tuple[int, ...] | None, size: tuple[int, int]) -> bool:
    """Whether ``shape`` is (1, C, h, w) with h x w the input's size over one stride."""
    if shape is None or len(shape) != 4 or shape[0] != 1 or min(shape) < 1:
        return False
    (h, w), (height, width) = shape[2:], size
    return height % h == 0 and width % w == 0 and height // h == width // w


def _walk_tail(graph: Any, output: Any, size: tuple[int, int]) -> tuple[list[Any], list[Any]]:
    """The tail's nodes and the head tensors it starts from (in no order)."""
    gs = _gs()
    inputs = {id(t) for t in graph.inputs}
    heads: list[Any] = []
    nodes: list[Any] = []
    seen: set[int] = set()
    stack = [output]
    while stack:
        tensor = stack.pop()
        if isinstance(tensor, gs.Constant) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if id(tensor) in inputs:
            raise ModelError(
                f"walking back from {output.name!r} reached the model input {tensor.name!r} "
                "without finding the heads: no (1, C, h, w) tensor that the tail flattens; "
                "is this a YOLOv5, YOLOv8/YOLO11 or YOLOX export with its decode tail?"
            )
        if not tensor.inputs:
            continue
        node = tensor.inputs[0]
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        for index, source in enumerate(node.inputs):
            if (
                node.op in _FLATTENING
                and index == 0
                and not isinstance(source, gs.Constant)
                and _is_grid(_shape(source), size)
            ):
                if all(source is not h for h in heads):
                    heads.append(source)
                continue
            stack.append(source)
    return nodes, heads


def _recognize(ops: set[str], head: str | None, where: str) -> str:
    if head is not None:
        if head not in HEADS:
            raise ModelError(f"head={head!r} is not one of {', '.join(map(repr, HEADS))}")
        return HEADS[head]
    found = [
        family
        for family, sign in (("yolov8", "Softmax"), ("yolox", "Exp"), ("yolov5", "Pow"))
        if sign in ops
    ]
    if len(found) != 1:
        raise ModelError(
            f"cannot tell the detector family of {where} from its tail (operations: "
            f"{', '.join(sorted(ops))}); name it with --head "
            f"({', '.join(HEADS)})"
        )
    return found[0]


def load(model: Any) -> Any:
    """An ONNX ModelProto (a path, bytes or a model) with its shapes inferred."""
    import onnx

    try:
        if isinstance(model, onnx.ModelProto):
            proto = model
        elif isinstance(model, (bytes, bytearray)):
            proto = onnx.load_from_string(bytes(model))
        else:
            proto = onnx.load(model)
        return onnx.shape_inference.infer_shapes(proto)
    except Exception as exc:
        if isinstance(exc, OSError):
            raise ModelError(f"cannot read the ONNX model {model!r}: {exc}") from exc
        raise ModelError(f"not a readable ONNX model: {exc}") from exc


def find_heads(model: Any, *, head: str | None = None, where: str = "the model") -> HeadCut:
    """The heads of a detector export (a ModelProto with shapes inferred), checked against
    the family's arithmetic (ModelError naming what does not fit)."""
    graph = _import(model)
    if len(graph.inputs) != 1:
        raise ModelError(f"{where} has {len(graph.inputs)} inputs; a detector takes one image")
    image = graph.inputs[0]
    in_shape = _shape(image)
    if in_shape is None or len(in_shape) != 4 or in_shape[0] != 1:
        raise ModelError(
            f"{where}: input {image.name!r} has shape {image.shape}; the DLA needs a static "
            "(1, 3, H, W) image (export with a fixed size and batch 1, no --dynamic)"
        )
    output = graph.outputs[0]
    height, width = in_shape[2:]
    nodes, heads = _walk_tail(graph, output, (height, width))
    family = _recognize({node.op for node in nodes}, head, where)
    if not heads:
        raise ModelError(f"{where}: no head output found before {output.name!r}")
    ordered = sorted(heads, key=lambda t: -(_shape(t) or (0, 0, 0, 0))[2])
    strides = []
    for tensor in ordered:
        strides.append(height // (_shape(tensor) or (0, 0, 1, 1))[2])
    if len(set(strides)) != len(strides):
        raise ModelError(f"{where}: two heads share a stride ({strides})")
    cut = HeadCut(
        family=family,
        heads=tuple(t.name for t in ordered),
        shapes=tuple(_shape(t) for t in ordered),  # type: ignore[misc]
        strides=tuple(strides),
        classes=0,
        input_name=image.name,
        input_size=(height, width),
        output_name=output.name,
    )
    return _read_parameters(model, cut, where)


def _output_shape(model: Any, name: str) -> tuple[int, ...]:
    for value in model.graph.output:
        if value.name == name:
            return tuple(d.dim_value for d in value.type.tensor_type.shape.dim)
    raise ModelError(f"no output {name!r}")  # pragma: no cover (the walk started there)


def _read_parameters(model: Any, cut: HeadCut, where: str) -> HeadCut:
    """Classes, anchors and reg_max from the graph, then the tail held against them."""
    out_shape = _output_shape(model, cut.output_name)
    session = _session(tail_model(model, cut))
    cells = sum(shape[2] * shape[3] for shape in cut.shapes)
    channels = [shape[1] for shape in cut.shapes]
    shape_text = "x".join(map(str, out_shape))
    if len(out_shape) != 3 or 0 in out_shape:
        raise ModelError(f"{where}: output {cut.output_name!r} is {shape_text}, not (1, N, K)")
    if cut.family == "yolov8":
        classes = out_shape[1] - 4
        reg_max, rest = divmod(channels[0] - classes, 4)
        if rest or reg_max < 1 or out_shape[2] != cells or len(set(channels)) != 1:
            raise ModelError(
                f"{where}: a YOLOv8-style output (1, 4 + classes, N) of {shape_text} does not "
                f"fit heads of {channels} channels over {cells} cells"
            )
        cut = dataclasses.replace(cut, classes=classes, reg_max=reg_max)
    else:
        per = out_shape[2]
        anchors_per = out_shape[1] // cells if out_shape[1] % cells == 0 else 0
        expected = anchors_per * per if cut.family == "yolov5" else per
        if (
            per < 6
            or anchors_per < 1
            or any(c != expected for c in channels)
            or (cut.family == "yolox" and anchors_per != 1)
        ):
            raise ModelError(
                f"{where}: a {cut.family} output (1, N, 5 + classes) of {shape_text} does not "
                f"fit heads of {channels} channels over {cells} cells"
            )
        cut = dataclasses.replace(cut, classes=per - 5)
        if cut.family == "yolov5":
            cut = _probe_anchors(session, cut, anchors_per, where)
    return _hold_against(session, cut, where)


def _session(model: Any) -> Any:
    import onnxruntime

    return onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )


def _run_tail(session: Any, cut: HeadCut, heads: Sequence[_Array]) -> _Array:
    feeds = {name: np.asarray(h, np.float32) for name, h in zip(cut.heads, heads, strict=True)}
    (result,) = session.run([cut.output_name], feeds)
    return np.asarray(result, np.float64)


def _probe_anchors(session: Any, cut: HeadCut, count: int, where: str) -> HeadCut:
    """YOLOv5's anchors from the tail on zero logits; its strides checked likewise."""
    zeros = [np.zeros(shape, np.float32) for shape in cut.shapes]
    rows = _run_tail(session, cut, zeros)[0]
    anchors = []
    offset = 0
    for shape, stride in zip(cut.shapes, cut.strides, strict=True):
        cells = shape[2] * shape[3]
        first = rows[offset : offset + count * cells : cells]  # cell (0, 0) of each anchor
        if not np.allclose(first[:, :2], stride / 2, rtol=1e-5):
            raise ModelError(
                f"{where}: the YOLOv5 tail puts cell (0, 0) of stride {stride} at "
                f"{first[0, :2].tolist()}, not at {stride / 2} (is it a YOLOv5 export?)"
            )
        anchors.append(tuple(float(v) for v in first[:, 2:4].ravel()))
        offset += count * cells
    return dataclasses.replace(cut, anchors=tuple(anchors))


def _hold_against(session: Any, cut: HeadCut, where: str) -> HeadCut:
    """The tail on random heads against the family's arithmetic: the cut is right only
    if they agree (to float32 rounding)."""
    rng = np.random.default_rng(43)
    heads = [(rng.standard_normal(shape) * 2).astype(np.float32) for shape in cut.shapes]
    if cut.family == "yolox":  # objectness and classes leave the head as probabilities
        for h in heads:
            h[:, 4:] = 1 / (1 + np.exp(-h[:, 4:]))
    got = _run_tail(session, cut, heads)
    want = export_output(cut.family, heads, cut.strides, anchors=cut.anchors, reg_max=cut.reg_max)
    if got.shape != want.shape:
        raise ModelError(
            f"{where}: the tail gives {got.shape}, a {cut.family} tail would give {want.shape}"
        )
    gap = np.abs(got - want) / np.maximum(1.0, np.abs(want))
    worst = float(gap.max())
    if not worst < 1e-4:
        raise ModelError(
            f"{where}: the graph's tail does not compute a {cut.family} decode of its heads "
            f"(relative difference {worst:.3g}); name the family with --head, or the export "
            "has a tail aiodla does not know"
        )
    return dataclasses.replace(cut, max_difference=worst)


def tail_model(model: Any, cut: HeadCut) -> Any:
    """The removed tail alone: the heads in, the export's output out."""
    import onnx

    graph = _import(model)
    tensors = graph.tensors()
    graph.inputs = [
        tensors[name].to_variable(dtype=np.float32, shape=list(shape))
        for name, shape in zip(cut.heads, cut.shapes, strict=True)
    ]
    graph.outputs = [tensors[cut.output_name]]
    graph.cleanup().toposort()
    return onnx.shape_inference.infer_shapes(_gs().export_onnx(graph))


def trim(model: Any, cut: HeadCut) -> Any:
    """The network without its tail: the image in, the raw heads out, named
    ``head_stride<s>``."""
    import onnx

    graph = _import(model)
    tensors = graph.tensors()
    outputs = []
    for name, new, shape in zip(cut.heads, cut.names, cut.shapes, strict=True):
        tensor = tensors[name]
        tensor.name = new
        outputs.append(tensor.to_variable(dtype=np.float32, shape=list(shape)))
    graph.outputs = outputs
    graph.cleanup().toposort()
    trimmed = _gs().export_onnx(graph)
    trimmed.ir_version = model.ir_version
    onnx.checker.check_model(trimmed)
    return trimmed
