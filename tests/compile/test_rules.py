"""The DLA layer check: every unsupported kind of layer is flagged with its rule, and
the trimmed networks of every family pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs onnx (aiodla[compile])")
pytest.importorskip("onnxruntime", reason="needs onnxruntime (aiodla[compile])")
pytest.importorskip("onnx_graphsurgeon", reason="needs onnx-graphsurgeon (aiodla[compile])")

import onnx
from onnx import TensorProto, helper, numpy_helper

from aiodla.compile import check_layers
from aiodla.compile._heads import find_heads, load, trim
from aiodla.compile._rules import rules

import detector_graphs as graphs


def graph(
    nodes: list[Any],
    consts: dict[str, Any],
    out_shape: list[Any],
    in_shape: list[Any] | None = None,
) -> Any:
    """A model of ``nodes`` from input ``x`` (1x16x32x32 unless said) to output ``y``."""
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape or [1, 16, 32, 32])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
            initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def conv(**attrs: Any) -> Any:
    k = attrs.pop("k", 3)
    out = attrs.pop("out", 8)
    w = np.zeros((out, 16 // attrs.get("group", 1), k, k), np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[k, k], **attrs)
    return graph([node], {"w": w}, [1, out, None, None])


def single(
    op: str,
    inputs: list[str],
    consts: dict[str, Any],
    out_shape: list[Any],
    in_shape: list[Any] | None = None,
    **attrs: Any,
) -> Any:
    return graph([helper.make_node(op, inputs, ["y"], **attrs)], consts, out_shape, in_shape)


I64 = np.int64
F32 = np.float32
# kind -> (the model, the rule it breaks)
UNSUPPORTED = {
    "exp": (lambda: single("Exp", ["x"], {}, [1, 16, 32, 32]), "unsupported"),
    "gather": (
        lambda: single("Gather", ["x", "i"], {"i": np.array([0, 1], I64)}, [1, 2, 32, 32], axis=1),
        "unsupported",
    ),
    "matmul": (
        lambda: single("MatMul", ["x", "m"], {"m": np.ones((32, 32), F32)}, [1, 16, 32, 32]),
        "unsupported",
    ),
    "unknown op": (lambda: single("Hardmax", ["x"], {}, [1, 16, 32, 32]), "unknown"),
    "hard swish": (lambda: single("HardSwish", ["x"], {}, [1, 16, 32, 32]), "unsupported"),
    "conv kernel 33": (lambda: conv(k=33, pads=[16] * 4, strides=[1, 1]), "kernel"),
    "conv stride 9": (lambda: conv(strides=[9, 9]), "stride"),
    # (with a kernel of at most 32, padding over 31 is also padding beyond the kernel)
    "conv pad 32": (lambda: conv(k=3, pads=[32] * 4), "padding padding_below_kernel"),
    "conv pad >= kernel": (lambda: conv(k=3, pads=[3] * 4), "padding_below_kernel"),
    "conv dilation 33": (lambda: conv(dilations=[33, 33], pads=[1] * 4), "dilation"),
    "conv weights not constant": (
        lambda: graph(
            [
                helper.make_node("Relu", ["x"], ["r"]),
                helper.make_node("Conv", ["x", "r"], ["y"], kernel_shape=[32, 32]),
            ],
            {},
            [1, 1, 1, 1],
            in_shape=[1, 16, 32, 32],
        ),
        "weights",
    ),
    "deconv padding": (
        lambda: single(
            "ConvTranspose",
            ["x", "w"],
            {"w": np.zeros((16, 4, 2, 2), F32)},
            [1, 4, None, None],
            pads=[1, 1, 1, 1],
            strides=[2, 2],
        ),
        "padding",
    ),
    "max pool window 9": (
        lambda: single("MaxPool", ["x"], {}, [1, 16, None, None], kernel_shape=[9, 9]),
        "window",
    ),
    "avg pool stride 17": (
        lambda: single(
            "AveragePool", ["x"], {}, [1, 16, None, None], kernel_shape=[2, 2], strides=[17, 17]
        ),
        "stride",
    ),
    "global pool over 32x32": (
        lambda: single("GlobalAveragePool", ["x"], {}, [1, 16, 1, 1]),
        "window",
    ),
    "concat on height": (lambda: single("Concat", ["x", "x"], {}, [1, 16, 64, 32], axis=2), "axis"),
    "resize by 64": (
        lambda: single(
            "Resize",
            ["x", "", "s"],
            {"s": np.array([1, 1, 64, 64], F32)},
            [1, 16, None, None],
            mode="nearest",
        ),
        "nearest",
    ),
    "resize by 1.5": (
        lambda: single(
            "Resize",
            ["x", "", "s"],
            {"s": np.array([1, 1, 1.5, 1.5], F32)},
            [1, 16, None, None],
            mode="nearest",
        ),
        "scales",
    ),
    "resize cubic": (
        lambda: single(
            "Resize",
            ["x", "", "s"],
            {"s": np.array([1, 1, 2, 2], F32)},
            [1, 16, None, None],
            mode="cubic",
        ),
        "mode",
    ),
    "softmax on width": (lambda: single("Softmax", ["x"], {}, [1, 16, 32, 32], axis=3), "axis"),
    "clip to 200": (
        lambda: single(
            "Clip",
            ["x", "lo", "hi"],
            {"lo": np.array(0, F32), "hi": np.array(200, F32)},
            [1, 16, 32, 32],
        ),
        "clip",
    ),
    "slice with step 2": (
        lambda: single(
            "Slice",
            ["x", "s", "e", "a", "t"],
            {
                "s": np.array([0], I64),
                "e": np.array([16], I64),
                "a": np.array([1], I64),
                "t": np.array([2], I64),
            },
            [1, 8, 32, 32],
        ),
        "step",
    ),
    "transpose of the batch": (
        lambda: single("Transpose", ["x"], {}, [16, 1, 32, 32], perm=[1, 0, 2, 3]),
        "batch",
    ),
    "quantize with a zero point": (
        lambda: single(
            "QuantizeLinear",
            ["x", "s", "z"],
            {"s": np.array(0.1, F32), "z": np.array(3, np.int8)},
            [1, 16, 32, 32],
        ),
        "symmetric",
    ),
    "five dimensions": (
        lambda: single("Relu", ["x"], {}, [1, 2, 8, 32, 32], in_shape=[1, 2, 8, 32, 32]),
        "rank",
    ),
    "dimension over 8192": (
        lambda: single("Relu", ["x"], {}, [1, 16, 1, 9000], in_shape=[1, 16, 1, 9000]),
        "max_dimension",
    ),
    "dynamic dimension": (
        lambda: single("Relu", ["x"], {}, ["n", 16, 32, 32], in_shape=["n", 16, 32, 32]),
        "static",
    ),
}


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED))
def test_each_unsupported_kind_is_flagged_with_its_rule(kind: str) -> None:
    make, rule = UNSUPPORTED[kind]
    findings = check_layers(make())
    assert [f.rule for f in findings] == rule.split(), findings
    text = str(findings[0])
    assert findings[0].op in text
    assert len(findings[0].text) > 20  # the rule's own words, not a code


def test_the_supported_layers_pass() -> None:
    w = np.zeros((16, 16, 3, 3), F32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c"], ["s"]),
        helper.make_node("Mul", ["c", "s"], ["m"]),
        helper.make_node("MaxPool", ["m"], ["p"], kernel_shape=[5, 5], pads=[2, 2, 2, 2]),
        helper.make_node("Resize", ["p", "", "sc"], ["r"], mode="nearest"),
        helper.make_node("MaxPool", ["r"], ["q"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Concat", ["q", "m"], ["y"], axis=1),
    ]
    model = graph(nodes, {"w": w, "sc": np.array([1, 1, 2, 2], F32)}, [1, 32, 32, 32])
    assert check_layers(model) == []


@pytest.mark.parametrize("family", sorted(graphs.FAMILIES))
def test_every_familys_trimmed_network_passes_and_its_export_does_not(family: str) -> None:
    export = load(graphs.FAMILIES[family]())
    trimmed = onnx.shape_inference.infer_shapes(trim(export, find_heads(export)))
    assert check_layers(trimmed) == []
    assert check_layers(export)  # the tail the cut removed would not run on the DLA


def test_the_rules_name_their_tensorrt_version() -> None:
    table = rules()
    assert table["tensorrt"].startswith("10.")
    assert "DLA Supported Layers" in table["source"]
    for op, entry in table["layers"].items():
        if "same_as" in entry:
            assert entry["same_as"] in table["layers"], op
