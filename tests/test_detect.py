"""Detect and Detections: the configuration (validated in one place, errors naming the
value), head matching at open, and the numpy path held to the plain reference of
tests/detect_reference.py and, where torch is installed, to torchvision's batched NMS."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
import pytest
from detect_reference import cap_heads, heads_for, plan_for
from detect_reference import run as reference_run
from detect_reference import to_frame as reference_to_frame

from aiodla import Detect, Detections, ImagePreprocess
from aiodla._detect_math import Candidates, exp32, iou_threshold32, select, sigmoid32
from aiodla._errors import ConfigurationError
from aiodla._tensors import TensorSpec

F = np.float32

# (head, keywords): every kind and alias, the options that change the arithmetic.
DETECTORS = {
    "yolov5": Detect(head="yolov5", classes=3, conf=0.3, iou=0.45),
    "yolov7_agnostic": Detect(head="yolov7", classes=2, conf=0.2, class_agnostic=True),
    "yolov8": Detect(head="yolov8", classes=4, conf=0.3, reg_max=5),
    "yolo11_strides": Detect(head="yolo11", classes=2, reg_max=4, strides=(16, 32)),
    "yolox": Detect(head="yolox", classes=3, conf=0.3, iou=0.5),
    "boxes": Detect(head="boxes", classes=3, conf=0.2, iou=0.3),
    "capped": Detect(head="yolov5", classes=2, conf=0.05, max_det=7, max_candidates=25),
    # strides that are no powers of two: every product rounds
    "yolox_strides_12_24": Detect(head="yolox", classes=2, conf=0.3, strides=(12, 24)),
}


class TestConfiguration:
    @pytest.mark.parametrize(
        ("keywords", "message"),
        [
            ({"head": "yolov6"}, "head='yolov6' is not one of"),
            ({"classes": 0}, "classes=0 must be within"),
            ({"classes": 2.0}, "classes=2.0 must be an integer"),
            ({"classes": True}, "classes=True must be an integer"),
            ({"conf": 1.0}, r"conf=1.0 must be within \[0, 1\)"),
            ({"conf": -0.1}, "conf=-0.1 must be within"),
            ({"conf": "0.3"}, "conf='0.3' must be a number"),
            ({"iou": math.nan}, "iou=nan must be within"),
            ({"max_det": 0}, "max_det=0 must be within"),
            ({"max_det": 500, "max_candidates": 100}, "max_det=500 must not exceed"),
            ({"max_candidates": 1 << 17}, "max_candidates=131072 must be within"),
            ({"reg_max": 0}, "reg_max=0 must be within"),
            ({"class_agnostic": 1}, "class_agnostic=1 must be a bool"),
            ({"strides": (16, 8, 32)}, "must be increasing"),
            ({"strides": (8, 0)}, "0 is not a positive integer"),
            ({"strides": "8"}, "must be a non-empty sequence"),
            ({"anchors": ((10, 13),)}, "has 1 entries, one per stride"),
            ({"anchors": ((10, 13, 5), (1, 2), (3, 4))}, "must hold w, h pairs"),
            ({"anchors": ((10, -13), (1, 2), (3, 4))}, "-13 is not > 0"),
            ({"outputs": "p8"}, "must be a sequence of names"),
            ({"outputs": ("a", "a", "b")}, "names a tensor twice"),
            ({"outputs": ("a", "b")}, "names 2 tensors; head='yolov5' with strides"),
            ({"layout": "rows"}, "layout= is for head='boxes', not 'yolov5'"),
            ({"head": "boxes", "layout": "nhwc"}, "layout='nhwc' is not one of 'columns', 'rows'"),
        ],
    )
    def test_refused(self, keywords: dict[str, Any], message: str) -> None:
        keywords = {"head": "yolov5", **keywords}
        with pytest.raises(ConfigurationError, match=message):
            Detect(**keywords)

    def test_options_for_other_heads_are_refused(self) -> None:
        with pytest.raises(ConfigurationError, match="anchors= is for anchor-based heads"):
            Detect(head="yolov8", anchors=((1, 2),) * 3)
        with pytest.raises(ConfigurationError, match="is for grid heads"):
            Detect(head="boxes", strides=(8,))

    def test_defaults_are_the_reference_implementations(self) -> None:
        v5, v7 = Detect(head="yolov5"), Detect(head="yolov7")
        assert v5.strides == (8, 16, 32) and v5.anchors is not None
        assert v5.anchors[0] == (10, 13, 16, 30, 33, 23)
        assert v7.anchors is not None and v7.anchors[2] == (142, 110, 192, 243, 459, 401)
        assert (v5.classes, v5.conf, v5.iou, v5.max_det) == (80, 0.25, 0.45, 300)
        assert v5.channels(3) == 255 and Detect(head="yolov8").channels() == 144
        assert Detect(head="yolox").channels() == 85 and Detect(head="boxes").channels() == 84


SPECS_640 = [
    TensorSpec(name, (1, 255, size, size), "float16", "chw16")
    for name, size in (("out20", 20), ("out80", 80), ("out40", 40))
]


class TestMatching:
    def test_by_spatial_size(self) -> None:
        plan = Detect(head="yolov5").plan((640, 640), SPECS_640)
        assert [s.name for s in plan.specs] == ["out80", "out40", "out20"]
        assert [layout.offset for layout in plan.layouts] == [0, 19200, 24000]
        assert plan.cells == 25200

    def test_by_name(self) -> None:
        """A decoy of the same size comes first: by size it would be taken, by name not."""
        specs = [
            TensorSpec(name, (1, 144, size, size), "float16", "chw16")
            for name, size in (("decoy", 8), ("p16", 4), ("p8", 8))
        ]
        detect = Detect(head="yolov8", strides=(8, 16))
        assert [s.name for s in detect.plan((64, 64), specs).specs] == ["decoy", "p16"]
        named = Detect(head="yolov8", strides=(8, 16), outputs=("p8", "p16"))
        assert [s.name for s in named.plan((64, 64), specs).specs] == ["p8", "p16"]

    @pytest.mark.parametrize(
        ("detect", "specs", "message"),
        [
            (Detect(head="yolov5"), SPECS_640[:2], "no output of 40x40 for stride 16"),
            (Detect(head="yolov5", classes=81), SPECS_640,
             "output 'out80' has 255 channels; head='yolov5' with classes=81 and 3 anchors "
             "needs 258"),
            (Detect(head="yolov8"), SPECS_640, "output 'out80' has 255 channels.*reg_max=16"),
            (Detect(head="yolov5", outputs=("out80", "out40", "nope")), SPECS_640,
             "names 'nope', which the model does not output"),
            (Detect(head="yolov5", outputs=("out40", "out80", "out20")), SPECS_640,
             "output 'out40' is 40x40; stride 8 of a 640x640 input gives 80x80"),
            (Detect(head="boxes"), SPECS_640, "head='boxes' needs outputs="),
            (Detect(head="yolov5", strides=(8, 16, 32)),
             [TensorSpec("b", (2, 255, 80, 80), "float16", "chw16"), *SPECS_640[::2]],
             "output 'b': Detect takes batch 1"),
        ],
    )  # fmt: skip
    def test_mismatch_names_the_tensor(
        self, detect: Detect, specs: list[TensorSpec], message: str
    ) -> None:
        with pytest.raises(ConfigurationError, match=message):
            detect.plan((640, 640), specs)


def boxes_plan(shape: tuple[int, int, int, int], **keywords: Any) -> Any:
    detect = Detect(head="boxes", classes=3, conf=0.2, iou=0.3, **keywords)
    return detect.plan((640, 640), [TensorSpec("out", shape, "float16", "nchw")])


class TestBoxesLayout:
    """head='boxes' reads (4 + classes) x N and N x (4 + classes) outputs: the shape
    decides, ``layout=`` where it cannot."""

    @pytest.mark.parametrize(
        ("shape", "rows", "count"),
        [
            ((1, 7, 1, 150), False, 150),  # as YOLOv8 exports 1 x 84 x 8400
            ((1, 7, 10, 15), False, 150),
            ((1, 1, 7, 150), False, 150),
            ((1, 150, 7, 1), True, 150),  # 1 x 8400 x 84
            ((1, 1, 150, 7), True, 150),
            ((1, 150, 1, 7), True, 150),
            ((1, 10, 15, 7), True, 150),
            ((1, 7, 1, 1), False, 1),
            ((1, 1, 7, 1), False, 1),  # one candidate reads the same either way
        ],
    )
    def test_the_shape_decides(self, shape: Any, rows: bool, count: int) -> None:
        (layout,) = boxes_plan(shape).layouts
        assert (layout.rows, layout.cells) == (rows, count)

    @pytest.mark.parametrize(
        ("shape", "keywords", "message"),
        [
            ((1, 7, 7, 1), {}, r"output 'out' is 1x7x7x1: with classes=3 it reads as "
             r"\(4 \+ classes\) x N and as N x \(4 \+ classes\), N = 7; say which with "
             r"Detect\(layout='columns'\) or Detect\(layout='rows'\)"),
            ((1, 7, 2, 7), {}, "reads as .* N = 14; say which"),
            ((1, 8, 1, 150), {}, r"output 'out' is 1x8x1x150; head='boxes' with classes=3 "
             r"needs 7 values a candidate: 7 channels \(\(4 \+ classes\) x N\) or a last "
             r"dimension of 7 \(N x \(4 \+ classes\)\)"),
            ((1, 150, 7, 1), {"layout": "columns"}, r"output 'out' is 1x150x7x1; head='boxes' "
             r"with classes=3 and layout='columns' \(\(4 \+ classes\) x N\) needs channels "
             r"\(or channels x height\) of 7"),
            ((1, 7, 1, 150), {"layout": "rows"},
             r"layout='rows' \(N x \(4 \+ classes\)\) needs a last dimension \(or height x "
             r"width\) of 7"),
        ],
    )  # fmt: skip
    def test_refused_at_open(self, shape: Any, keywords: dict[str, Any], message: str) -> None:
        with pytest.raises(ConfigurationError, match=message):
            boxes_plan(shape, **keywords)

    @pytest.mark.parametrize(("layout", "count"), [("columns", 7), ("rows", 7)])
    def test_layout_settles_an_ambiguous_shape(self, layout: str, count: int) -> None:
        (read,) = boxes_plan((1, 7, 7, 1), layout=layout).layouts
        assert (read.rows, read.cells) == (layout == "rows", count)

    @pytest.mark.parametrize("shape", [(1, 150, 7, 1), (1, 1, 150, 7), (1, 10, 15, 7)])
    @pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
    def test_rows_equal_columns_and_the_reference(self, shape: Any, ties: bool) -> None:
        """The same candidates as rows and as columns give the same bits; the numpy path
        on rows equals the plain reference."""
        detect = Detect(head="boxes", classes=3, conf=0.2, iou=0.3)
        columns = plan_for(detect)
        rows = plan_for(detect, boxes=shape)
        assert rows.layouts[0].rows and not columns.layouts[0].rows
        heads = heads_for(columns, np.random.default_rng(zlib.crc32(f"{shape} {ties}".encode())),
                          ties=ties)  # fmt: skip
        matrix = heads[0].reshape(7, 150)
        transposed = [np.ascontiguousarray(matrix.T).reshape(shape)]
        want, got = columns.run(heads), rows.run(transposed)
        assert len(want) > 5
        assert got.boxes.tobytes() == want.boxes.tobytes()
        assert got.scores.tobytes() == want.scores.tobytes()
        assert got.classes.tolist() == want.classes.tolist()
        assert_same(rows, transposed, got)


class TestDetections:
    def test_protocols(self) -> None:
        boxes = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], F)
        d = Detections(boxes, np.array([0.9, 0.5], F), np.array([3, 1], np.int32))
        assert len(d) == 2 and repr(d) == "<Detections [2 boxes]>"
        (b0, s0, c0), (_, _, c1) = list(d)
        assert b0.tolist() == [1, 2, 3, 4] and (s0, c0) == (F(0.9), 3) and c1 == 1
        assert isinstance(s0, float) and isinstance(c0, int)
        assert d.to_dict() == {
            "boxes": [[1, 2, 3, 4], [5, 6, 7, 8]],
            "scores": [float(F(0.9)), 0.5],
            "classes": [3, 1],
        }

    def test_results_types(self) -> None:
        plan = plan_for(DETECTORS["yolov5"])
        result = plan.run(heads_for(plan, np.random.default_rng(0), ties=False))
        assert len(result) > 5
        assert result.boxes.dtype == F and result.boxes.shape == (len(result), 4)
        assert result.scores.dtype == F and result.classes.dtype == np.int32
        assert (np.diff(result.scores) <= 0).all()


class TestArithmetic:
    def test_exp32_is_close_to_exp_and_to_the_reference(self) -> None:
        from detect_reference import exp32 as scalar_exp32

        x = np.linspace(-86, 86, 100_001, dtype=F)
        relative = np.abs(exp32(x) / np.exp(x.astype(np.float64)) - 1)
        assert relative.max() < 3 * 2.0**-24  # within a few ulp of exp
        picks = np.concatenate([x[::997], F([0.0, -0.0, 1e-30, 90.0, -100.0, np.inf, -np.inf])])
        vector = exp32(picks)
        for value, got in zip(picks, vector):
            assert got.tobytes() == scalar_exp32(value).tobytes(), value
        assert np.isnan(exp32(F([np.nan])))[0]
        assert sigmoid32(F([-np.inf, 0.0, np.inf])).tolist() == [sigmoid32(F([-86]))[0], 0.5, 1.0]


def test_float16_comparison_as_integers() -> None:
    """Every float16 value against bounds around, at and between float16 values."""
    from aiodla._detect_math import above

    values = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    values = values[~np.isnan(values)]
    bounds = [0.0, -0.0, 1e-9, -1e-9, 0.25, -1.0986123, 65504.0, -65504.0, 7e4, -7e4,
              float(np.float16(0.3)), np.inf, -np.inf, 5.96e-8, -5.96e-8]  # fmt: skip
    for bound in bounds:
        b = F(bound)
        assert (above(values, b) == (values.astype(F) > b)).all(), bound


def assert_same(plan: Any, heads: list[Any], result: Detections) -> None:
    expected = reference_run(plan, heads)
    assert len(result) == len(expected)
    found = plan.candidates(heads)
    by_index = dict(zip(found.ids.tolist(), range(len(found.ids))))
    for k, (index, box, score, cls) in enumerate(expected):
        assert index in by_index
        assert result.scores[k].tobytes() == F(score).tobytes(), k
        assert int(result.classes[k]) == cls, k
        assert result.boxes[k].tobytes() == np.array(box, F).tobytes(), k


@pytest.mark.parametrize("name", DETECTORS)
@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
def test_numpy_path_equals_the_reference(name: str, ties: bool) -> None:
    plan = plan_for(DETECTORS[name])
    rng = np.random.default_rng(zlib.crc32(f"{name} {ties}".encode()))
    heads = heads_for(plan, rng, ties=ties)
    result = plan.run(heads)
    assert len(result) > 1, "the case must keep boxes to compare"
    if name == "capped":
        assert len(plan.candidates(heads).scores) > 25 and len(result) == 7
    assert_same(plan, heads, result)


def test_float16_heads_read_as_float32() -> None:
    plan = plan_for(DETECTORS["yolov8"], dtype="float16")
    heads = heads_for(plan, np.random.default_rng(3), ties=False)
    assert heads[0].dtype == np.float16
    assert_same(plan, heads, plan.run(heads))


def test_empty_frames() -> None:
    for name, detect in DETECTORS.items():
        plan = plan_for(detect)
        heads = [np.full(spec.shape, -20.0, F) for spec in plan.specs]
        if detect.kind in ("yolox", "boxes"):
            heads = [np.zeros(spec.shape, F) for spec in plan.specs]
        result = plan.run(heads)
        assert len(result) == 0 and result.boxes.shape == (0, 4), name
        assert reference_run(plan, heads) == []


def test_nan_and_infinite_values_are_no_candidates() -> None:
    plan = plan_for(DETECTORS["boxes"])
    heads = heads_for(plan, np.random.default_rng(1), ties=False)
    heads[0][0, 0, 0, :10] = np.nan  # cx
    heads[0][0, 2, 0, 10:20] = np.inf  # w
    heads[0][0, 4:, 0, 20:30] = np.nan  # every class score
    found = plan.candidates(heads)
    assert not np.isin(found.ids, np.arange(30)).any()
    assert_same(plan, heads, plan.run(heads))


def test_cap_keeps_the_best_by_score_then_index() -> None:
    """Eight equal scores past a cap of five: the five lowest indices go on."""
    boxes = np.array([[10 * i, 0, 10 * i + 5, 5] for i in range(8)], F)  # no overlaps
    found = Candidates(boxes, np.full(8, 0.5, F), np.zeros(8, np.int32), np.arange(8)[::-1])
    kept = select(found, iou=0.5, max_det=8, max_candidates=5, class_agnostic=False)
    assert found.ids[kept].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("shape", [None, (1, 150, 7, 1)], ids=["columns", "rows"])
@pytest.mark.parametrize("cap", [25, 40], ids=["among distinct scores", "inside a tie"])
def test_the_cap_keeps_exactly_the_best(cap: int, shape: Any) -> None:
    """More candidates than the cap and ``max_det`` at the cap, NMS suppressing five
    within it: exactly the first ``cap`` by (score, index) go on, by the numpy path and
    by the plain reference alike, so fewer than ``max_det`` are kept (without the cap,
    candidates past it would be)."""
    detect = Detect(head="boxes", classes=3, conf=0.2, max_det=cap, max_candidates=cap)
    plan = plan_for(detect, boxes=shape)
    heads, found = cap_heads(plan, np.random.default_rng(cap))
    assert len(found) == 90
    want = [c for c in found[:cap] if not c[4]]
    assert len(want) == cap - 5
    result = plan.run(heads)
    assert result.boxes.tobytes() == np.array([c[1] for c in want], F).tobytes()
    assert result.scores.tobytes() == np.array([c[2] for c in want], F).tobytes()
    assert result.classes.tolist() == [c[3] for c in want]
    assert [c[0] for c in reference_run(plan, heads)] == [c[0] for c in want]


def test_iou_threshold_is_strict_and_plus_zero() -> None:
    """IoU exactly 0.5 (+0 widths) does not suppress at iou=0.5; at 0.49 it does."""
    boxes = np.array([[0, 0, 4, 4], [0, 0, 4, 2]], F)  # inter 8, union 16
    found = Candidates(boxes, F([0.9, 0.8]), np.zeros(2, np.int32), np.arange(2))
    assert select(found, iou=0.5, max_det=9, max_candidates=9, class_agnostic=False).size == 2
    assert select(found, iou=0.49, max_det=9, max_candidates=9, class_agnostic=False).size == 1
    other = found._replace(classes=np.array([0, 1], np.int32))
    assert select(other, iou=0.49, max_det=9, max_candidates=9, class_agnostic=False).size == 2
    assert select(other, iou=0.49, max_det=9, max_candidates=9, class_agnostic=True).size == 1


@pytest.mark.parametrize("resize", ["letterbox", "stretch"])
def test_boxes_in_frame_coordinates(resize: str) -> None:
    """Mapped and clipped into the frame, without the boxes that have nothing inside it
    (a 150 x 100 frame letterboxed into 64 x 96 leaves 26 columns of padding a side),
    counted as the plain reference counts them; every kept box has an area."""
    plan = plan_for(DETECTORS["yolov5"])
    heads = heads_for(plan, np.random.default_rng(7), ties=False)
    pre = ImagePreprocess(source="bgr", order="rgb", resize=resize)
    geometry = pre.geometry(150, 100, 64, 96)
    result = plan.run(heads, geometry, (150, 100))
    dropped: dict[str, int] = {}
    expected = reference_run(plan, heads, (geometry, 150, 100), dropped)
    assert len(result) == len(expected) > 0
    assert result.outside == dropped["outside"] and result.not_finite == 0
    assert (result.outside > 20) == (resize == "letterbox")  # stretch: no padding
    for k, (_, box, _, _) in enumerate(expected):
        want = np.array(reference_to_frame(box, geometry, 150, 100), F)
        assert result.boxes[k].tobytes() == want.tobytes()
    assert result.boxes.min() >= 0 and result.boxes[:, 0::2].max() <= 100
    assert result.boxes[:, 1::2].max() <= 150
    assert (result.boxes[:, 2] > result.boxes[:, 0]).all()
    assert (result.boxes[:, 3] > result.boxes[:, 1]).all()
    # the float64 mapping of Geometry.to_frame agrees to float32 rounding
    model = np.array([box for _, box, _, _ in expected], F)
    mapped = np.clip(geometry.to_frame(model), 0, [100, 150, 100, 150])
    assert np.allclose(result.boxes, mapped, rtol=1e-6, atol=1e-4)


def one_class_plan(detect: Detect, count: int) -> Any:
    spec = TensorSpec("boxes", (1, 4 + detect.classes, 1, count), "float32", "nchw")
    return detect.plan((64, 96), [spec])


def boxes_heads(rows: list[list[float]]) -> list[Any]:
    """One ``"boxes"`` head of one class: a row (cx, cy, w, h, score) per candidate."""
    matrix = np.array(rows, F).T
    return [matrix.reshape(1, 5, 1, len(rows))]


# A 100 x 100 frame letterboxed into 64 x 96: the picture is columns 16..80.
SQUARE = ImagePreprocess(source="bgr", order="rgb", resize="letterbox").geometry(100, 100, 64, 96)


class TestInsideTheFrame:
    """Step 4's last rule: a box with nothing inside the frame is dropped before the cap
    and NMS, and counted."""

    def test_a_box_in_the_padding_suppresses_nothing(self) -> None:
        # the best box lies wholly in the left padding (x 2..16); the next one overlaps
        # it by IoU 0.6 and reaches 2 pixels into the picture: it is kept
        plan = one_class_plan(Detect(head="boxes", classes=1, iou=0.45), 2)
        heads = boxes_heads([[9.0, 20.0, 14.0, 10.0, 0.9], [11.0, 20.0, 14.0, 10.0, 0.8]])
        assert len(plan.run(heads)) == 1  # in model pixels: NMS suppresses the second
        result = plan.run(heads, SQUARE, (100, 100))
        assert result.scores.tolist() == [F(0.8)] and result.outside == 1
        x1, y1, x2, y2 = result.boxes[0].tolist()
        assert x1 == 0.0 and x2 > 0.0 and y2 > y1
        assert "1 outside the frame" in repr(result)

    def test_a_box_in_the_padding_takes_no_place_under_the_cap(self) -> None:
        detect = Detect(head="boxes", classes=1, max_det=1, max_candidates=1)
        plan = one_class_plan(detect, 3)
        heads = boxes_heads(
            [[5.0, 30.0, 4.0, 4.0, 0.9], [90.0, 30.0, 4.0, 4.0, 0.8], [40.0, 30.0, 4.0, 4.0, 0.7]]
        )
        result = plan.run(heads, SQUARE, (100, 100))
        assert result.scores.tolist() == [F(0.7)] and result.outside == 2

    def test_a_box_that_only_touches_the_frame_is_dropped(self) -> None:
        # x2 exactly on the picture's left edge: clipped to [0, 0], no area; one of no
        # height; one reaching a hundredth of a pixel in is kept
        plan = one_class_plan(Detect(head="boxes", classes=1), 3)
        heads = boxes_heads(
            [[12.0, 30.0, 8.0, 4.0, 0.9], [40.0, 30.0, 4.0, 0.0, 0.8], [12.01, 30.0, 8.0, 4.0, 0.7]]
        )
        result = plan.run(heads, SQUARE, (100, 100))
        assert result.scores.tolist() == [F(0.7)] and result.outside == 2
        without = plan.run(heads)  # no frame: nothing dropped (the first suppresses the third)
        assert without.scores.tolist() == [F(0.9), F(0.8)] and without.outside == 0

    def test_no_frame_drops_nothing(self) -> None:
        plan = plan_for(DETECTORS["yolov5"])
        heads = heads_for(plan, np.random.default_rng(7), ties=False)
        assert plan.run(heads).outside == 0
        assert len(plan.run(heads)) == len(reference_run(plan, heads))


class TestNotFinite:
    """A score or box that is not finite (an overflow in the model) is no candidate and
    is counted; the frame's other detections stand."""

    def test_infinite_scores_are_dropped_and_counted(self) -> None:
        plan = one_class_plan(Detect(head="boxes", classes=1), 4)
        heads = boxes_heads(
            [
                [10.0, 10.0, 4.0, 4.0, np.inf],
                [30.0, 10.0, 4.0, 4.0, 0.5],
                [50.0, 10.0, np.inf, 4.0, 0.6],
                [70.0, 10.0, 4.0, 4.0, -np.inf],
            ]
        )
        result = plan.run(heads)
        assert result.scores.tolist() == [F(0.5)]
        assert result.not_finite == 2 and result.outside == 0  # -inf never passed conf
        assert "2 not finite" in repr(result)
        dropped: dict[str, int] = {}
        reference_run(plan, heads, None, dropped)
        assert dropped == {"outside": 0, "not_finite": 2}

    def test_yolox_overflowing_objectness(self) -> None:
        detect = DETECTORS["yolox"]
        plan = plan_for(detect)
        heads = heads_for(plan, np.random.default_rng(2), ties=False)
        want = plan.run(heads)
        cell = plan.candidates(heads).ids[0]  # a cell that passes
        k = next(k for k, lay in enumerate(plan.layouts) if cell < lay.offset + lay.cells)
        head, layout = heads[k], plan.layouts[k]
        y, x = divmod(int(cell - layout.offset), layout.width)
        head[0, 4, y, x] = np.inf
        result = plan.run(heads)
        assert np.isfinite(result.scores).all() and result.not_finite == 1
        assert cell not in plan.candidates(heads).ids
        assert len(result) >= len(want) - 1


# -- torchvision, where installed ------------------------------------------------------------


@pytest.mark.parametrize("agnostic", [False, True])
@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
def test_against_torchvision_batched_nms(agnostic: bool, ties: bool) -> None:
    """The kept set and order of batched_nms on the same candidates. torchvision sorts
    with an unstable sort, so it is given the candidates' ranks in the defined order
    (score, then index) as scores: the suppression is what is compared."""
    torch = pytest.importorskip("torch", reason="torch is not installed (optional reference)")
    ops = pytest.importorskip("torchvision.ops", reason="torchvision is not installed")
    detect = Detect(head="boxes", classes=3, conf=0.2, iou=0.4, max_det=4096,
                    class_agnostic=agnostic)  # fmt: skip
    plan = plan_for(detect)
    for seed in range(5):
        heads = heads_for(plan, np.random.default_rng(seed), ties=ties)
        found = plan.candidates(heads)
        order = np.lexsort((found.ids, -found.scores))
        ranks = np.empty(len(order), np.float32)
        ranks[order] = np.arange(len(order), 0, -1)
        idxs = (
            torch.zeros(len(order), dtype=torch.int64)
            if agnostic
            else torch.from_numpy(found.classes.astype(np.int64))
        )
        boxes, scores = torch.from_numpy(found.boxes), torch.from_numpy(ranks)
        if agnostic:
            keep = ops.batched_nms(boxes, scores, idxs, detect.iou).numpy()
        else:
            # batched_nms's path for large inputs (one nms per class, merged by score):
            # for small ones it offsets each class's boxes by a multiple of the largest
            # coordinate, which rounds the boxes' float32 bits and so moves IoUs by ulps.
            per_class = [
                np.flatnonzero(found.classes == c)[
                    ops.nms(boxes[found.classes == c], scores[found.classes == c], detect.iou)
                ]
                for c in np.unique(found.classes)
            ]
            merged = np.concatenate(per_class)
            keep = merged[np.argsort(-ranks[merged], kind="stable")]
        ours = select(found, iou=detect.iou, max_det=detect.max_det,
                      max_candidates=detect.max_candidates, class_agnostic=agnostic)  # fmt: skip
        assert ours.tolist() == keep.tolist()


def test_the_iou_threshold_compares_as_torchvisions_double() -> None:
    """torchvision compares its float32 IoU with the threshold as a double: a float32
    IoU equal to float32(0.4), just above 0.4, suppresses there. The float32 threshold
    both paths use must agree with that comparison for every float32 near it."""
    rng = np.random.default_rng(7)
    for iou in [0.4, 0.45, 0.5, 0.7, 1.0, 0.0, *rng.random(200).tolist()]:
        threshold = iou_threshold32(iou)
        near = F(iou)
        for x in (
            np.nextafter(near, F(-1)),
            near,
            np.nextafter(near, F(2)),
            np.nextafter(np.nextafter(near, F(2)), F(2)),
        ):
            assert bool(x > threshold) == (float(x) > iou), (iou, x, threshold)
    assert float(iou_threshold32(0.4)) < 0.4 < float(F(0.4))


class TestEdges:
    """Edges of the definition a random head seldom reaches: ties with ``conf``, a NaN
    class, overflowing areas, more kept boxes than one block of NMS rows, odd strides."""

    def test_a_score_equal_to_conf_is_no_candidate(self) -> None:
        plan = one_class_plan(Detect(head="boxes", classes=1, conf=0.25), 2)
        heads = boxes_heads([[10.0, 10.0, 4.0, 4.0, 0.25], [30.0, 10.0, 4.0, 4.0, 0.3125]])
        assert plan.run(heads).scores.tolist() == [0.3125]

    def test_a_yolox_score_equal_to_conf_is_no_candidate(self) -> None:
        # objectness 0.5 passes conf 0.25; its product with a class of 0.5 ties it
        plan = plan_for(Detect(head="yolox", classes=1, conf=0.25))
        heads = [np.zeros(spec.shape, F) for spec in plan.specs]
        heads[0][0, 4, 1, 1], heads[0][0, 5, 1, 1] = 0.5, 0.5
        heads[0][0, 4, 1, 3], heads[0][0, 5, 1, 3] = 0.5, 0.625
        assert plan.run(heads).scores.tolist() == [0.3125]

    def test_scores_above_one_pass_a_high_conf(self) -> None:
        # "boxes" scores are the model's values, not probabilities
        plan = one_class_plan(Detect(head="boxes", classes=1, conf=0.9), 2)
        heads = boxes_heads([[10.0, 10.0, 4.0, 4.0, 1.5], [30.0, 10.0, 4.0, 4.0, 0.5]])
        assert plan.run(heads).scores.tolist() == [1.5]

    def test_just_above_conf(self) -> None:
        """A YOLOv5 cell whose score passes ``conf`` by less than 0.1 %: the prefilter on
        the objectness logit lets it through."""
        detect = Detect(head="yolov5", classes=1, conf=0.25)
        plan = plan_for(detect)
        heads = [np.full(spec.shape, -20.0, F) for spec in plan.specs]
        head = heads[plan.specs.index(next(s for s in plan.specs if s.shape[2] == 8))]
        head[0, 4, 3, 5] = math.log(0.2502 / (1 - 0.2502))  # objectness 0.2502
        head[0, 5, 3, 5] = 20.0  # the class: 1.0
        head[0, :4, 3, 5] = 0.0
        result = plan.run(heads)
        assert len(result) == 1 and 0.25 < result.scores[0] < 0.2503
        assert_same(plan, heads, result)

    def test_conf_zero(self) -> None:
        plan = plan_for(Detect(head="yolov5", classes=2, conf=0.0, max_det=30))
        heads = heads_for(plan, np.random.default_rng(9), ties=False)
        result = plan.run(heads)
        assert len(result) == 30
        assert_same(plan, heads, result)

    def test_yolox_objectness_at_most_conf(self) -> None:
        """YOLOX's objectness must pass ``conf`` itself (step 3): a class value above 1
        does not carry a cell whose objectness does not."""
        plan = plan_for(Detect(head="yolox", classes=2, conf=0.3))
        heads = [np.zeros(spec.shape, F) for spec in plan.specs]
        head = heads[0]
        head[0, 4, 1, 1], head[0, 5, 1, 1] = 0.3, 2.0  # score 0.6, objectness at conf
        head[0, 4, 1, 3], head[0, 5, 1, 3] = 0.5, 0.8  # score 0.4: a candidate
        assert plan.run(heads).scores.tolist() == [F(0.4)]
        assert len(reference_run(plan, heads)) == 1

    def test_a_nan_class_loses_to_the_others(self) -> None:
        """NaN compares as -inf: a cell with one NaN class value is a candidate of its
        best other class."""
        plan = one_class_plan(Detect(head="boxes", classes=3), 2)
        matrix = np.array([[10.0, 10.0, 4.0, 4.0, np.nan, 0.75, 0.5],
                           [30.0, 10.0, 4.0, 4.0, 0.5, np.nan, 0.625]], F).T  # fmt: skip
        heads = [matrix.reshape(1, 7, 1, 2)]
        result = plan.run(heads)
        assert result.scores.tolist() == [0.75, 0.625]
        assert result.classes.tolist() == [1, 2]

    def test_more_kept_boxes_than_a_block_of_rows(self) -> None:
        """600 boxes apart: all kept, in score order, past the first 256 rows of the
        suppression mask."""
        n = 600
        boxes = np.array([[10 * i, 0, 10 * i + 5, 5] for i in range(n)], F)
        scores = np.linspace(0.9, 0.3, n, dtype=F)
        found = Candidates(boxes, scores, np.zeros(n, np.int32), np.arange(n))
        kept = select(found, iou=0.5, max_det=n, max_candidates=n, class_agnostic=False)
        assert kept.tolist() == list(range(n)) and kept.dtype == np.int64

    def test_boxes_whose_area_overflows(self) -> None:
        """Finite boxes of 1e20 pixels: their float32 areas are inf, so their IoU is NaN
        and suppresses nothing; no warning (the tests turn warnings into errors)."""
        boxes = np.array([[-1e20, -1e20, 1e20, 1e20], [-1e20, -1e20, 1e20, 1e20]], F)
        found = Candidates(boxes, F([0.9, 0.8]), np.zeros(2, np.int32), np.arange(2))
        kept = select(found, iou=0.5, max_det=9, max_candidates=9, class_agnostic=False)
        assert kept.tolist() == [0, 1]

    def test_types_of_the_results(self) -> None:
        empty = Candidates.empty()
        assert [a.shape for a in empty[:4]] == [(0, 4), (0,), (0,), (0,)]
        assert [a.dtype for a in empty[:4]] == [F, F, np.int32, np.int64]
        plan = plan_for(DETECTORS["yolov5"])
        heads = heads_for(plan, np.random.default_rng(7), ties=False)
        assert plan.candidates(heads).ids.dtype == np.int64
        nothing = plan.run([np.full(spec.shape, -20.0, F) for spec in plan.specs])
        assert [nothing.boxes.dtype, nothing.scores.dtype, nothing.classes.dtype] == [
            F, F, np.int32
        ]  # fmt: skip
        assert nothing.outside == nothing.not_finite == 0

    def test_exp32_and_sigmoid32_compute_in_float32(self) -> None:
        x = np.linspace(-90.0, 90.0, 1001)  # float64, most not float32 values
        for f in (exp32, sigmoid32):
            got = f(x)
            assert got.dtype == F
            assert got.tobytes() == f(x.astype(F)).tobytes()

    def test_above_for_float32_and_an_infinite_bound(self) -> None:
        from aiodla._detect_math import above

        values = np.array([0.25, 0.5, np.inf], F)
        assert above(values, F(0.25)).tolist() == [False, True, True]
        half = values.astype(np.float16)
        nothing = above(half, F(np.inf))
        assert nothing.dtype == bool and not nothing.any()

    @pytest.mark.parametrize("size", [(100, 200), (300, 100)], ids=["wide", "tall"])
    def test_frame_mapping_with_padding_on_either_axis(self, size: tuple[int, int]) -> None:
        """Letterbox padding above and below (top > 0), or beside: boxes mapped with
        both offsets, as the plain reference maps them."""
        plan = plan_for(DETECTORS["yolov8"])
        heads = heads_for(plan, np.random.default_rng(5), ties=False)
        pre = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
        geometry = pre.geometry(*size, 64, 96)
        assert (geometry.top > 0) == (size == (100, 200))
        result = plan.run(heads, geometry, size)
        dropped: dict[str, int] = {}
        expected = reference_run(plan, heads, (geometry, *size), dropped)
        assert len(result) == len(expected) > 0 and result.outside == dropped["outside"]
        for k, (_, box, _, _) in enumerate(expected):
            want = np.array(reference_to_frame(box, geometry, *size), F)
            assert result.boxes[k].tobytes() == want.tobytes()

    def test_nothing_outside_counts_zero(self) -> None:
        plan = one_class_plan(Detect(head="boxes", classes=1), 1)
        result = plan.run(boxes_heads([[40.0, 30.0, 4.0, 4.0, 0.5]]), SQUARE, (100, 100))
        assert len(result) == 1 and result.outside == 0
