"""The cut: each family's export is recognized, trimmed at its raw heads, and the trimmed
network + Detect gives the full graph's own detections on onnxruntime."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs onnx (aiodla[compile])")
pytest.importorskip("onnxruntime", reason="needs onnxruntime (aiodla[compile])")
pytest.importorskip("onnx_graphsurgeon", reason="needs onnx-graphsurgeon (aiodla[compile])")

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from aiodla import Detect, ModelError, TensorSpec
from aiodla.compile import export_output, exporter_detections
from aiodla.compile._heads import find_heads, load, trim

import detector_graphs as graphs


def run(model: Any, x: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    data = model if isinstance(model, bytes) else model.SerializeToString()
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {"images": x})))


def detections_of(detect: Detect, heads: dict[str, np.ndarray[Any, Any]]) -> Any:
    specs = [TensorSpec(name, array.shape) for name, array in heads.items()]
    plan = detect.plan((graphs.SIZE, graphs.SIZE), specs)
    return plan.run([heads[spec.name] for spec in plan.specs])


def assert_same_detections(
    got: Any, want: tuple[Any, Any, Any], *, score_tol: float = 1e-4, box_tol: float = 0.5
) -> None:
    """One to one: every reference detection has its own detection of the same class,
    the box within ``box_tol`` pixels and the score within ``score_tol`` (in any order:
    two scores within rounding of each other may come in either order)."""
    boxes, scores, classes = want
    got_boxes, got_scores = np.asarray(got.boxes), np.asarray(got.scores)
    got_classes = np.asarray(got.classes)
    assert len(got) == len(scores), (len(got), len(scores))
    free = np.ones(len(got), bool)
    for box, score, cls in zip(boxes, scores, classes):
        fits = (
            free
            & (got_classes == cls)
            & (np.abs(got_boxes - box).max(axis=1) <= box_tol)
            & (np.abs(got_scores - score) <= score_tol)
        )
        assert fits.any(), f"no detection of class {cls} at {box} with score {score}"
        free[np.flatnonzero(fits)[0]] = False


@pytest.fixture(scope="module", params=sorted(graphs.FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def export(family: str) -> Any:
    return load(graphs.FAMILIES[family]())


class TestCut:
    def test_recognizes_the_family_and_reads_its_settings(self, family: str, export: Any) -> None:
        cut = find_heads(export)
        assert cut.family == graphs.HEADS[family]
        assert cut.strides == graphs.STRIDES
        assert cut.classes == graphs.CLASSES
        assert cut.input_size == (graphs.SIZE, graphs.SIZE)
        if family == "yolov5":
            assert cut.anchors == tuple(tuple(map(float, row)) for row in graphs.ANCHORS)
        if cut.family == "yolov8":
            assert cut.reg_max == 16
        assert cut.max_difference < 1e-4

    def test_trimmed_network_and_detect_give_the_exports_detections(
        self, family: str, export: Any
    ) -> None:
        cut = find_heads(export)
        trimmed = trim(export, cut)
        kinds = {node.op_type for node in trimmed.graph.node}
        assert not kinds & {"Reshape", "Transpose", "Softmax", "Exp", "Pow", "Split", "Slice"}
        detect = Detect(**cut.detect_settings())
        seen = 0
        for x in graphs.images(6, seed=len(family)):  # random, structured, alternating
            want = exporter_detections(cut.family, run(export, x)[cut.output_name])
            got = detections_of(detect, run(trimmed, x))
            assert_same_detections(got, want)
            seen += len(got)
        assert seen > 20

    def test_the_tail_reference_is_the_graphs_tail(self, family: str, export: Any) -> None:
        """export_output (the compiler's reference) against the full graph itself: the
        trimmed heads through it give the graph's output."""
        cut = find_heads(export)
        x = graphs.images(1)[0]
        heads = run(trim(export, cut), x)
        want = run(export, x)[cut.output_name]
        got = export_output(
            cut.family, [heads[n] for n in cut.names], cut.strides, anchors=cut.anchors
        )
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def _tiny(
    nodes: list[Any],
    inits: list[Any],
    out_shape: list[int],
    *,
    in_shape: Any = None,
    inputs: int = 1,
) -> Any:
    graph = helper.make_graph(
        nodes,
        "t",
        [
            helper.make_tensor_value_info(
                "images" if i == 0 else f"extra{i}",
                TensorProto.FLOAT,
                in_shape or [1, 3, 64, 64],
            )
            for i in range(inputs)
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, out_shape)],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return load(model)


def _conv_tail(tail: str) -> Any:
    """A conv head at stride 8 and a tail of one op ``tail`` after a flatten."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [7, 3, 8, 8], np.ones(7 * 3 * 64) * 0.01)
    shape = helper.make_tensor("shape", TensorProto.INT64, [3], [1, 7, 64])
    nodes = [
        helper.make_node("Conv", ["images", "w"], ["head"], kernel_shape=[8, 8], strides=[8, 8]),
        helper.make_node("Reshape", ["head", "shape"], ["flat"]),
        helper.make_node("Transpose", ["flat"], ["rows"], perm=[0, 2, 1]),
        helper.make_node(tail, ["rows"], ["out"]),
    ]
    return _tiny(nodes, [w, shape], [1, 64, 7])


class TestRefusals:
    def test_a_tail_of_no_known_family_asks_for_head(self) -> None:
        with pytest.raises(ModelError, match=r"cannot tell the detector family.*--head"):
            find_heads(_conv_tail("Relu"))

    def test_a_named_family_whose_arithmetic_the_tail_lacks_is_refused(self) -> None:
        with pytest.raises(ModelError, match="does not compute a yolox decode"):
            find_heads(_conv_tail("Exp"))
        with pytest.raises(ModelError, match="does not compute a yolox decode"):
            find_heads(_conv_tail("Relu"), head="yolox")

    def test_a_wrong_head_name_is_refused(self, export: Any) -> None:
        with pytest.raises(ModelError, match="head='ssd' is not one of"):
            find_heads(export, head="ssd")

    def test_the_wrong_family_named_is_caught_by_the_check(self, family: str, export: Any) -> None:
        wrong = "yolox" if graphs.HEADS[family] != "yolox" else "yolov8"
        with pytest.raises(ModelError, match=r"does not|does not fit"):
            find_heads(export, head=wrong)

    def test_a_graph_without_heads_is_refused(self) -> None:
        w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3], np.ones(108))
        nodes = [
            helper.make_node("Conv", ["images", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("GlobalAveragePool", ["c"], ["out"]),
        ]
        with pytest.raises(ModelError, match="reached the model input 'images'"):
            find_heads(_tiny(nodes, [w], [1, 4, 1, 1]))

    def test_a_dynamic_or_batched_input_is_refused(self) -> None:
        nodes = [helper.make_node("Relu", ["images"], ["out"])]
        with pytest.raises(ModelError, match=r"static \(1, 3, H, W\) image"):
            find_heads(_tiny(nodes, [], ["n", 3, 64, 64], in_shape=["n", 3, 64, 64]))

    def test_two_inputs_are_refused(self) -> None:
        nodes = [helper.make_node("Add", ["images", "extra1"], ["out"])]
        with pytest.raises(ModelError, match="has 2 inputs"):
            find_heads(_tiny(nodes, [], [1, 3, 64, 64], inputs=2))

    def test_an_unreadable_file_is_a_model_error(self, tmp_path: Any) -> None:
        path = tmp_path / "broken.onnx"
        path.write_bytes(b"not a protobuf")
        with pytest.raises(ModelError):
            load(str(path))
        with pytest.raises(ModelError, match="cannot read the ONNX model"):
            load(str(tmp_path / "missing.onnx"))


def test_onnx_is_saved_with_the_heads_named_by_stride(export: Any) -> None:
    trimmed = trim(export, find_heads(export))
    onnx.checker.check_model(trimmed)
    assert [o.name for o in trimmed.graph.output] == [f"head_stride{s}" for s in graphs.STRIDES]
