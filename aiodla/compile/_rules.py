"""Every layer of a network held against the DLA's documented layer support, before a
build: :func:`check_layers`.

The limits and the rule texts live in one data file, ``dla_rules.json`` (TensorRT's
"DLA Supported Layers and Restrictions", the version it names); this module maps each
ONNX operation to the checks its TensorRT layer needs. A finding names the node, its
operation, the rule and the rule's text; an empty list means every layer fits the table
(the build itself may still find what no table says).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from importlib import resources
from typing import Any

import numpy as np

__all__ = ["Finding", "check_layers", "rules"]

_Checker = Callable[[Any, dict[str, Any], "_Graph"], list[tuple[str, str]]]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One layer that would not run on the DLA, and the rule it breaks."""

    node: str
    op: str
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.node} ({self.op}): {self.text}"


def rules() -> dict[str, Any]:
    """The rules data file, parsed."""
    text = resources.files(__package__).joinpath("dla_rules.json").read_text("utf-8")
    document: dict[str, Any] = json.loads(text)
    return document


class _Graph:
    """Shapes and constants of a model with its shapes inferred."""

    def __init__(self, model: Any) -> None:
        from onnx import numpy_helper

        graph = model.graph
        self.constants: dict[str, Any] = {
            t.name: numpy_helper.to_array(t) for t in graph.initializer
        }
        for node in graph.node:
            if node.op_type == "Constant":
                for a in node.attribute:
                    if a.name == "value":
                        self.constants[node.output[0]] = numpy_helper.to_array(a.t)
        for node in graph.node:  # explicit quantization: dequantized weights are constants
            if node.op_type == "DequantizeLinear" and node.input[0] in self.constants:
                self.constants.setdefault(node.output[0], self.constants[node.input[0]])
        self.shapes: dict[str, tuple[int | None, ...]] = {}
        for value in [*graph.input, *graph.value_info, *graph.output]:
            dims = value.type.tensor_type.shape.dim
            self.shapes[value.name] = tuple(
                d.dim_value if d.HasField("dim_value") else None for d in dims
            )

    def shape(self, name: str) -> tuple[int | None, ...] | None:
        if name in self.constants:
            return tuple(np.shape(self.constants[name]))
        return self.shapes.get(name)


def _attr(node: Any, name: str, default: Any) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _within(values: Any, bounds: list[int]) -> bool:
    return all(bounds[0] <= int(v) <= bounds[1] for v in values)


def _conv(node: Any, limits: dict[str, Any], graph: _Graph) -> list[tuple[str, str]]:
    broken = []
    weight = graph.shape(node.input[1])
    kernel = _attr(node, "kernel_shape", list(weight[2:]) if weight else [])
    pads = _attr(node, "pads", [0] * 2 * len(kernel))
    strides = _attr(node, "strides", [1] * len(kernel))
    dilations = _attr(node, "dilations", [1] * len(kernel))
    group = _attr(node, "group", 1)
    if any(name not in graph.constants for name in node.input[1:]):
        broken.append("weights")
    if not _within(kernel, limits["kernel"]):
        broken.append("kernel")
    if node.op_type == "Conv":
        if not _within(pads, limits["padding"]):
            broken.append("padding")
        if any(p >= k for p, k in zip(pads, [*kernel, *kernel], strict=True)):
            broken.append("padding_below_kernel")
        if not _within(dilations, limits["dilation"]):
            broken.append("dilation")
        if not limits["groups"][0] <= group <= limits["groups"][1]:
            broken.append("groups")
    else:
        if any(pads):
            broken.append("padding")
        if any(d != 1 for d in dilations):
            broken.append("dilation")
        if group != 1:
            broken.append("groups")
    if not _within(strides, limits["stride"]):
        broken.append("stride")
    maps = weight[0] if weight and node.op_type == "Conv" else None
    if node.op_type == "ConvTranspose" and weight:
        maps = (weight[1] or 0) * group
    if maps is not None and not _within([maps], limits["output_maps"]):
        broken.append("output_maps")
    return [(rule, rule) for rule in broken]


def _pool(node: Any, limits: dict[str, Any], graph: _Graph) -> list[tuple[str, str]]:
    broken = []
    if node.op_type.startswith("Global"):
        shape = graph.shape(node.input[0]) or ()
        if len(shape) == 4 and not _within([s or 0 for s in shape[2:]], limits["window"]):
            broken.append("window")
        return [(r, r) for r in broken]
    kernel = _attr(node, "kernel_shape", [])
    if not _within(kernel, limits["window"]):
        broken.append("window")
    if not _within(_attr(node, "pads", [0] * 2 * len(kernel)), limits["padding"]):
        broken.append("padding")
    if not _within(_attr(node, "strides", [1] * len(kernel)), limits["stride"]):
        broken.append("stride")
    if _attr(node, "ceil_mode", 0):
        broken.append("ceil_mode")
    return [(r, r) for r in broken]


def _clip(node: Any, limits: dict[str, Any], graph: _Graph) -> list[tuple[str, str]]:
    low = graph.constants.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    high = graph.constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    low = _attr(node, "min", None) if low is None else low
    high = _attr(node, "max", None) if high is None else high
    ok = (
        low is not None
        and high is not None
        and float(low) == 0.0
        and limits["range"][0] <= float(high) <= limits["range"][1]
    )
    return [] if ok else [("clip", "clip")]


def _concat(node: Any, limits: dict[str, Any], graph: _Graph) -> list[tuple[str, str]]:
    rank = len(graph.shape(node.output[0]) or (0,) * 4)
    axis = _attr(node, "axis", 1)
    broken = [] if axis in (1, 1 - rank) else ["axis"]
    if len([i for i in node.input if i]) < 2:
        broken.append("inputs")
    return [(r, r) for r in broken]


def _resize(node: Any, limits: dict[str, Any], graph: _Graph) -> list[tuple[str, str]]:
    mode = _attr(node, "mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    scales: Any = None
    if len(node.input) > 2 and node.input[2] in graph.constants:
        scales = graph.constants[node.input[2]]
    if (scales is None or not np.size(scales)) and len(node.input) > 3:
        sizes = graph.constants.get(node.input[3])
        before = graph.shape(node.input[0])
        if sizes is not None and before and None not in before:
            scales = np.asarray(sizes, np.float64) / np.asarray(before, np.float64)
    if mode not in ("nearest", "linear"):
        return [("mode", "mode")]
    if scales is None or np.size(scales) != 4:
        return [("scales", "scales")]
    s = [float(v) for v in np.ravel(scales)]
    if s[0] != 1 or s[1] != 1 or s[2] != s[3] or s[2] != int(s[2]):
        return [("scales", "scales")]
    bounds = limits[mode]
    return [] if bounds[0] <= s[2] <= bounds[1] else [(mode, mode)]


def _softmax(node: Any, limits: dict[str, Any], graph: _Graph) -> list[tuple[str, str]]:
    shape = graph.shape(node.input[0]) or ()
    axis = _attr(node, "axis", -1)
    if len(shape) != 4 or axis not in (1, -3):
        return [("axis", "axis")]
    return []


def _slice(node: Any, limits: dict[str, Any], graph: _Graph) -> list[tuple[str, str]]:
    if node.op_type == "Split":
        return [] if _attr(node, "axis", 0) not in (0, -4) else [("batch", "batch")]
    if any(name not in graph.constants for name in node.input[1:] if name):
        return [("constant", "constant")]
    axes = graph.constants.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    steps = graph.constants.get(node.input[4]) if len(node.input) > 4 and node.input[4] else None
    broken = []
    if steps is not None and any(int(s) != 1 for s in np.ravel(steps)):
        broken.append("step")
    if axes is None or any(int(a) in (0, -4) for a in np.ravel(axes)):
        broken.append("batch") if axes is not None else None
    return [(r, r) for r in broken]


def _shuffle(node: Any, limits: dict[str, Any], graph: _Graph) -> list[tuple[str, str]]:
    if node.op_type == "Transpose":
        perm = list(_attr(node, "perm", []))
        return [] if perm[:1] == [0] else [("batch", "batch")]
    before, after = graph.shape(node.input[0]), graph.shape(node.output[0])
    if not before or not after or before[0] != after[0]:
        return [("batch", "batch")]
    return []


def _quantize(node: Any, limits: dict[str, Any], graph: _Graph) -> list[tuple[str, str]]:
    scale = graph.constants.get(node.input[1])
    zero = graph.constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    ok = (
        scale is not None
        and bool(np.all(np.asarray(scale) > 0))
        and (zero is None or (np.asarray(zero).dtype == np.int8 and not np.any(zero)))
    )
    return [] if ok else [("symmetric", "symmetric")]


def _constants_only(node: Any, limits: dict[str, Any], graph: _Graph) -> list[tuple[str, str]]:
    rule = "slope" if node.op_type == "PRelu" else "weights"
    return [] if all(n in graph.constants for n in node.input[1:] if n) else [(rule, rule)]


_CHECKS: dict[str, _Checker] = {
    "Conv": _conv,
    "ConvTranspose": _conv,
    "MaxPool": _pool,
    "AveragePool": _pool,
    "GlobalAveragePool": _pool,
    "GlobalMaxPool": _pool,
    "Clip": _clip,
    "Concat": _concat,
    "Resize": _resize,
    "Softmax": _softmax,
    "Slice": _slice,
    "Split": _slice,
    "Transpose": _shuffle,
    "Reshape": _shuffle,
    "QuantizeLinear": _quantize,
    "DequantizeLinear": _quantize,
    "PRelu": _constants_only,
    "BatchNormalization": _constants_only,
    "Gemm": _constants_only,
}
# Operations whose tensors are not 4-D activations: Q/DQ of weights, Reshape's shape.
_ANY_RANK = {"QuantizeLinear", "DequantizeLinear", "Identity"}


def check_layers(model: Any) -> list[Finding]:
    """Each layer of ``model`` (an ONNX ModelProto, shapes inferred) that breaks a rule
    of the DLA's table, with the rule; an empty list when all fit."""
    table = rules()
    general, layers = table["general"], table["layers"]
    graph = _Graph(model)
    findings: list[Finding] = []
    for index, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{index}"
        op = node.op_type
        if op == "Constant":
            continue
        if op in table["unsupported"]:
            findings.append(Finding(name, op, "unsupported", table["unsupported"][op]))
            continue
        entry = layers.get(op)
        if entry is None:
            findings.append(Finding(name, op, "unknown", table["unknown"].format(op=op)))
            continue
        limits = layers[entry["same_as"]] if "same_as" in entry else entry
        texts = limits.get("rules", {})
        for key, rule in _CHECKS[op](node, limits, graph) if op in _CHECKS else []:
            findings.append(Finding(name, op, key, texts[rule]))
        if op in _ANY_RANK:
            continue
        findings.extend(_general(name, op, node, graph, general))
    return findings


def _general(
    name: str, op: str, node: Any, graph: _Graph, general: dict[str, Any]
) -> list[Finding]:
    texts = general["rules"]
    found: list[Finding] = []
    for tensor in [*node.input, *node.output]:
        if not tensor or tensor in graph.constants:
            continue
        shape = graph.shape(tensor)
        if shape is None or None in shape:
            found.append(Finding(name, op, "static", texts["static"]))
        elif len(shape) != general["rank"]:
            found.append(
                Finding(name, op, "rank", f"{texts['rank']} ({tensor!r} has shape {list(shape)})")
            )
        elif shape[0] is not None and shape[0] > general["max_batch"]:
            found.append(Finding(name, op, "max_batch", texts["max_batch"]))
        elif any((d or 0) > general["max_dimension"] for d in shape[1:]):
            found.append(
                Finding(
                    name,
                    op,
                    "max_dimension",
                    f"{texts['max_dimension']} ({tensor!r} has shape {list(shape)})",
                )
            )
        else:
            continue
        break  # one general finding per layer is enough to name it
    return found
