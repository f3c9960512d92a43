"""The detector kernels without a GPU: the generated source built as host C++ (one host
thread per CUDA thread; the one-block greedy pass with real threads and a barrier) and
run through ``DetectKernels.launch`` itself (fake NVRTC, a launcher calling the host
build with the very parameter blocks ``cuLaunchKernel`` would get), on heads packed
into their DLA layouts, compared with the numpy path on the same vectors; the NVRTC
compile for sm_87 and sm_90; and the errors."""

from __future__ import annotations

import ctypes
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from detect_reference import cap_heads, heads_for, plan_for
from host_kernels import HostLauncher, build_host_library, nvrtc_cubin

from aiodla import Detect, ImagePreprocess
from aiodla._detect import DetectPlan
from aiodla._tensors import TensorSpec
from aiodla.runtime import _conversion_kernels as ck
from aiodla.runtime._detect_kernels import DetectKernels, detect_source, read_output
from aiodla.runtime._detect_source import plan_detect
from aiodla.runtime._protocol import CudaCallError

from support import FakeToolchain

# Compiling (g++ for the host build, NVRTC) is CPU-bound: beside another suite on a
# 2-CPU machine one build passed the 60 s default meant to catch hangs.
pytestmark = pytest.mark.timeout(600)

F = np.float32

# Every kind, DLA layouts with lanes and padding, float16 and float32 heads, a cap that
# candidates exceed, class-agnostic NMS.
CASES = {
    "yolov5_chw16": (Detect(head="yolov5", classes=3, conf=0.3), "float16", "chw16"),
    "yolov7_nchw_agnostic": (
        Detect(head="yolov7", classes=2, conf=0.2, class_agnostic=True),
        "float32",
        "nchw",
    ),
    "yolov8_chw16": (Detect(head="yolov8", classes=4, conf=0.3, reg_max=5), "float16", "chw16"),
    "yolox_nhwc": (Detect(head="yolox", classes=3, conf=0.3, iou=0.5), "float32", "nhwc"),
    "boxes_chw16": (Detect(head="boxes", classes=3, conf=0.2, iou=0.3), "float16", "chw16"),
    "capped_chw32": (
        Detect(head="yolov5", classes=2, conf=0.05, max_det=7, max_candidates=25),
        "float16",
        "chw16",
    ),
    # N x (4 + classes): the candidates across the lanes of chw16, or across h and w
    "boxes_rows_chw16": (
        Detect(head="boxes", classes=3, conf=0.2, iou=0.3),
        "float16",
        "chw16",
        (1, 150, 7, 1),
    ),
    "boxes_rows_nhwc": (
        Detect(head="boxes", classes=3, conf=0.2, iou=0.3),
        "float32",
        "nhwc",
        (1, 10, 15, 7),
    ),
}


def dla_plan(
    detect: Detect, dtype: str, fmt: str, boxes: tuple[int, int, int, int] | None = None
) -> DetectPlan:
    logical = plan_for(detect, dtype=dtype, boxes=boxes)
    specs = [TensorSpec(s.name, s.shape, dtype, fmt) for s in logical.specs]
    return detect.plan((64, 96), specs)


def host_build(tmp_path: Path, source: str, heads: int) -> ctypes.CDLL:
    pointers = ", ".join(f"*(const void**)p[{k}]" for k in range(heads))
    one = "*(void**)p[0]"
    frame = ", ".join(f"*(u64*)p[{heads + 1 + k}]" for k in range(7))
    serial = {
        "aiodla_detect_reset": one,
        "aiodla_detect_decode": f"{pointers}, *(void**)p[{heads}], {frame}",
        "aiodla_detect_rank": one,
        "aiodla_detect_mask": one,
    }
    runners = [
        f'extern "C" void run_{name}(unsigned grid, void** p) {{\n'
        "  for (unsigned g = 0; g < grid; ++g) for (unsigned t = 0; t < BLOCK; ++t) {\n"
        f"    blockIdx = {{g, 0, 0}}; threadIdx = {{t, 0, 0}}; {name}({arguments}); }}\n}}\n"
        for name, arguments in serial.items()
    ]
    select = "*(const void**)p[0], *(void**)p[1], " + ", ".join(
        f"*(u64*)p[{k}]" for k in range(2, 9)
    )
    runners.append(
        'extern "C" void run_aiodla_detect_select(unsigned grid, void** p) {\n'
        "  std::barrier<> bar(BLOCK); block_barrier = &bar; std::vector<std::thread> ts;\n"
        "  for (unsigned t = 0; t < BLOCK; ++t) ts.emplace_back([=] {\n"
        f"    blockIdx = {{0, 0, 0}}; threadIdx = {{t, 0, 0}}; aiodla_detect_select({select}); }});\n"
        "  for (auto& th : ts) th.join();\n}\n"
    )
    return build_host_library(tmp_path, "detect", source, "".join(runners))


class HostDetector:
    """One case compiled through DetectKernels.compile (fake NVRTC) and launched through
    its launch (host build), with host buffers standing for the slot's device ones."""

    def __init__(self, plan: DetectPlan, tmp_path: Path) -> None:
        self.plan = plan
        library = host_build(tmp_path, detect_source(plan), len(plan.specs))
        toolchain = FakeToolchain()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ck, "_toolchain", lambda device: toolchain)
            self.kernels = DetectKernels.compile(plan, cache_dir=tmp_path / "cache")
        self.launcher = HostLauncher(library)
        self.kernels._launcher = self.launcher

    def run(self, heads: list[Any], geometry: Any = None, frame: Any = None) -> Any:
        # each head packed into its DLA layout, as the DLA task leaves it
        packed = [spec.pack(head) for spec, head in zip(self.plan.specs, heads, strict=True)]
        # stale bytes in the scratch and output: nothing may depend on them being zero
        work = aligned(self.kernels.work_bytes, fill=0x7F)
        out = aligned(self.kernels.out_bytes, fill=0x5A)
        self.kernels.launch(
            [p.ctypes.data for p in packed], work.ctypes.data, out.ctypes.data, 0, geometry, frame
        )
        return read_output(out, self.kernels.layout)


def aligned(size: int, fill: int) -> Any:
    raw = np.full(size + 16, fill, np.uint8)
    start = -raw.ctypes.data % 16
    return raw[start : start + size]


def assert_equal(got: Any, expected: Any) -> None:
    assert len(got) == len(expected)
    assert (got.outside, got.not_finite) == (expected.outside, expected.not_finite)
    assert got.boxes.tobytes() == expected.boxes.tobytes()
    assert got.scores.tobytes() == expected.scores.tobytes()
    assert got.classes.tolist() == expected.classes.tolist()


class Detectors:
    """Each case built on first use: one g++ run inside the test that needs it, so no
    single test pays for every build."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.built: dict[str, HostDetector] = {}

    def __getitem__(self, name: str) -> HostDetector:
        if name not in self.built:
            self.built[name] = HostDetector(dla_plan(*CASES[name]), self.factory.mktemp(name))
        return self.built[name]


@pytest.fixture(scope="module")
def detectors(tmp_path_factory: pytest.TempPathFactory) -> Detectors:
    return Detectors(tmp_path_factory)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
def test_host_build_matches_numpy(detectors: Detectors, name: str, ties: bool) -> None:
    detector = detectors[name]
    plan = detector.plan
    heads = heads_for(plan, np.random.default_rng(zlib.crc32(f"{name} {ties}".encode())), ties=ties)
    # the numpy path reads the logical arrays the DLA buffers hold
    logical = [
        spec.unpack(spec.pack(h)).astype(F) for spec, h in zip(plan.specs, heads, strict=True)
    ]
    expected = plan.run(logical)
    assert len(expected) > 1
    assert_equal(detector.run(heads), expected)
    assert detector.launcher.calls[-5:] == [
        "aiodla_detect_reset", "aiodla_detect_decode", "aiodla_detect_rank",
        "aiodla_detect_mask", "aiodla_detect_select",
    ]  # fmt: skip
    if name.startswith("capped"):
        assert len(plan.candidates(logical).scores) > 25 and len(expected) == 7


def test_host_build_empty_frame_and_repeat(detectors: Detectors) -> None:
    """No candidate at all gives 0 detections; the scratch of a previous frame changes
    nothing (the counter is reset, stale mask words are never read)."""
    detector = detectors["yolov5_chw16"]
    plan = detector.plan
    empty = [np.full(spec.shape, -20.0, F) for spec in plan.specs]
    assert len(detector.run(empty)) == 0
    heads = heads_for(plan, np.random.default_rng(11), ties=True)
    logical = [
        spec.unpack(spec.pack(h)).astype(F) for spec, h in zip(plan.specs, heads, strict=True)
    ]
    assert_equal(detector.run(heads), plan.run(logical))


@pytest.mark.parametrize("resize", ["letterbox", "stretch"])
def test_host_build_maps_into_the_frame(detectors: Detectors, resize: str) -> None:
    detector = detectors["yolov8_chw16"]
    plan = detector.plan
    heads = heads_for(plan, np.random.default_rng(5), ties=False)
    logical = [
        spec.unpack(spec.pack(h)).astype(F) for spec, h in zip(plan.specs, heads, strict=True)
    ]
    geometry = ImagePreprocess(source="bgr", order="rgb", resize=resize).geometry(150, 100, 64, 96)
    expected = plan.run(logical, geometry, (150, 100))
    assert expected.boxes.min() == 0.0  # clipping is exercised
    assert (expected.outside > 10) == (resize == "letterbox")  # and dropping, with padding
    assert_equal(detector.run(heads, geometry, (150, 100)), expected)


def test_host_build_drops_before_nms_what_lies_outside(detectors: Detectors) -> None:
    """A box wholly in the letterbox padding is dropped at decode: it neither suppresses
    the box beside it that reaches into the picture (IoU 0.6 > 0.3) nor is kept; its
    count reaches the output. Without a frame the kernels drop nothing."""
    detector = detectors["boxes_chw16"]
    plan = detector.plan
    # a 100 x 100 frame letterboxed into 64 x 96: the picture is columns 16..80
    geometry = ImagePreprocess(source="bgr", order="rgb", resize="letterbox").geometry(
        100, 100, 64, 96
    )
    matrix = np.zeros((7, 150), F)  # every other candidate below conf
    # (values exact in float16)
    matrix[:, 0] = [9.0, 20.0, 14.0, 10.0, 0.0, 0.875, 0.0]  # x 2..16: in the padding
    matrix[:, 1] = [11.0, 20.0, 14.0, 10.0, 0.0, 0.75, 0.0]  # x 4..18: 2 pixels in
    matrix[:, 2] = [12.0, 40.0, 8.0, 4.0, 0.0, 0.0, 0.625]  # x 8..16: touches the edge
    heads = [matrix.reshape(plan.specs[0].shape)]
    got = detector.run(heads, geometry, (100, 100))
    assert got.scores.tolist() == [0.75] and got.outside == 2
    assert_equal(got, plan.run(heads, geometry, (100, 100)))
    unmapped = detector.run(heads)
    assert unmapped.scores.tolist() == [0.875, 0.625] and unmapped.outside == 0


def test_host_build_counts_what_is_not_finite(detectors: Detectors) -> None:
    """A score of +inf (float16 overflow) or a box coordinate of inf: no candidate, and
    counted, as the numpy path counts them."""
    detector = detectors["boxes_chw16"]
    plan = detector.plan
    heads = heads_for(plan, np.random.default_rng(23), ties=False)
    matrix = heads[0].reshape(7, 150)
    matrix[4, :5] = np.inf  # class 0's score of five candidates
    matrix[2, 5:8] = np.inf  # three widths
    matrix[4:, 5:8] = 0.9
    expected = plan.run([h.astype(F) for h in heads])
    assert expected.not_finite == 8 and np.isfinite(expected.scores).all()
    assert_equal(detector.run(heads), expected)


@pytest.mark.parametrize(
    ("cap", "dtype", "fmt", "boxes"),
    [(25, "float16", "chw16", None), (40, "float32", "nhwc", (1, 150, 7, 1))],
    ids=["among distinct scores", "inside a tie, rows"],
)
def test_host_build_keeps_exactly_the_best_under_the_cap(
    tmp_path: Path, cap: int, dtype: str, fmt: str, boxes: Any
) -> None:
    """The rank kernel's cap: of 90 candidates only the first ``cap`` by (score, index)
    go on to NMS, which suppresses five of them; with ``max_det`` at the cap the rest
    would fill the gap if the cap let more on (tests/detect_reference.cap_heads)."""
    detect = Detect(head="boxes", classes=3, conf=0.2, max_det=cap, max_candidates=cap)
    plan = dla_plan(detect, dtype, fmt, boxes)
    heads, found = cap_heads(plan, np.random.default_rng(cap))
    want = [c for c in found[:cap] if not c[4]]
    got = HostDetector(plan, tmp_path).run(heads)
    assert got.boxes.tobytes() == np.array([c[1] for c in want], F).tobytes()
    assert got.scores.tobytes() == np.array([c[2] for c in want], F).tobytes()
    assert got.classes.tolist() == [c[3] for c in want]
    assert_equal(got, plan.run([h.astype(F) for h in heads]))


def test_host_build_reads_rows_as_columns(detectors: Detectors) -> None:
    """The same candidates as N x (4 + classes) (chw16: a candidate's values in one
    lane group, the candidates across surfaces) and as (4 + classes) x N give the same
    detections, bit for bit."""
    rows, columns = detectors["boxes_rows_chw16"], detectors["boxes_chw16"]
    assert rows.plan.layouts[0].rows and not columns.plan.layouts[0].rows
    heads = heads_for(columns.plan, np.random.default_rng(17), ties=True)
    matrix = heads[0].reshape(7, 150)
    transposed = [np.ascontiguousarray(matrix.T).reshape(1, 150, 7, 1)]
    want = columns.run(heads)
    assert len(want) > 5
    assert_equal(rows.run(transposed), want)


def test_yolov5s_shaped_heads(tmp_path: Path) -> None:
    """YOLOv5s' three FP16 chw16 heads of a 640x640 input, realistic sparsity."""
    specs = [
        TensorSpec(f"p{s}", (1, 255, 640 // s, 640 // s), "float16", "chw16") for s in (8, 16, 32)
    ]
    plan = Detect(head="yolov5").plan((640, 640), specs)
    detector = HostDetector(plan, tmp_path)
    rng = np.random.default_rng(29)
    heads = [rng.normal(-1.0, 1.0, spec.shape).astype(np.float16) for spec in specs]
    for head in heads:
        head[0, 4::85] -= 2.5  # few cells with objectness
    logical = [h.astype(F) for h in heads]
    expected = plan.run(logical)
    assert 10 < len(expected) < 300
    assert_equal(detector.run(heads), expected)


# -- the source, the launch checks, the errors ------------------------------------------------


def test_sizes_and_source() -> None:
    plan = dla_plan(*CASES["yolov5_chw16"])
    program = plan_detect(plan)
    cap, words = 4096, 64
    assert program.cells == plan.cells == 3 * (8 * 12 + 4 * 6 + 2 * 3)
    assert program.work_bytes >= 16 + 32 * plan.cells + 32 * cap + 8 * cap * words
    assert program.work_bytes % 16 == 0
    assert f"CONF = {int(F(0.3).view(np.uint32)):#010x}u" in program.source
    for k in range(3):
        assert program.source.count(f"struct H{k} ") == 1
    assert program.grids["aiodla_detect_mask"] == cap * words // 256


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeToolchain:
    toolchain = FakeToolchain()
    monkeypatch.setattr(ck, "_toolchain", lambda device: toolchain)
    return toolchain


def test_cache_and_launch_refusals(fake: FakeToolchain, tmp_path: Path) -> None:
    plan = dla_plan(*CASES["boxes_chw16"])
    first = DetectKernels.compile(plan, cache_dir=tmp_path)
    second = DetectKernels.compile(plan, cache_dir=tmp_path)
    assert not first.compiled_from_cache and second.compiled_from_cache and fake.compiled == 1
    second._launcher = lambda *args: (0,)
    with pytest.raises(ValueError, match="2 head buffers given, the plan has 1"):
        second.launch([0x100, 0x200], 0x1000, 0x2000, 0)
    with pytest.raises(ValueError, match="16-byte aligned"):
        second.launch([0x100], 0x1008, 0x2000, 0)
    second._launcher = lambda *args: (700,)
    with pytest.raises(CudaCallError) as info:
        second.launch([0x100], 0x1000, 0x2000, 0)
    assert info.value.code == 700


def test_corrupt_output_count_is_refused() -> None:
    plan = dla_plan(*CASES["boxes_chw16"])
    layout = DetectKernels(
        plan_detect(plan), {}, _layout(plan), from_cache=False, launcher=print
    ).layout
    raw = np.zeros(layout.size, np.uint8)
    raw[:4] = np.array([layout.max_det + 1], np.int32).view(np.uint8)
    with pytest.raises(ValueError, match="count of 301"):
        read_output(raw, layout)


def _layout(plan: DetectPlan) -> Any:
    from aiodla.runtime._detect_kernels import output_layout

    return output_layout(plan.detect.max_det)


@pytest.mark.parametrize("arch", ["sm_87", "sm_90"])
def test_nvrtc_compiles(arch: str) -> None:
    """No GPU needed: a source NVRTC refuses never reaches a Jetson (sm_87, Orin) or the
    H200 (sm_90) the GPU tests run on."""
    yolov5s = Detect(head="yolov5").plan(
        (640, 640),
        [
            TensorSpec(f"p{s}", (1, 255, 640 // s, 640 // s), "float16", "chw16")
            for s in (8, 16, 32)
        ],
    )
    for plan in [yolov5s] + [dla_plan(*case) for case in CASES.values()]:
        cubin = nvrtc_cubin(detect_source(plan), arch, "aiodla_detect")
        assert b"aiodla_detect_select" in cubin and b"aiodla_detect_decode" in cubin


def test_the_cuda_runtime_prepares_and_launches(
    fake: FakeToolchain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CudaRuntime.prepare_detect compiles through the shared path (fake NVRTC here) and
    CudaRuntime.detect launches the five kernels (the host build), as the engine calls
    them on a slot's stream."""
    from aiodla.runtime._cuda import CudaRuntime

    monkeypatch.setenv("AIODLA_CACHE_DIR", str(tmp_path / "cache"))
    plan = dla_plan(*CASES["yolox_nhwc"])
    library = host_build(tmp_path, detect_source(plan), len(plan.specs))
    runtime = CudaRuntime(0)
    kernels = runtime.prepare_detect(plan)
    assert fake.compiled == 1 and "3 heads, from nvrtc" in repr(kernels)
    launcher = HostLauncher(library)
    kernels._launcher = launcher
    heads = heads_for(plan, np.random.default_rng(3), ties=True)
    packed = [spec.pack(h) for spec, h in zip(plan.specs, heads, strict=True)]
    work = aligned(kernels.work_bytes, fill=0x7F)
    out = aligned(kernels.out_bytes, fill=0x5A)
    runtime.detect(kernels, [p.ctypes.data for p in packed], work.ctypes.data, out.ctypes.data, 0)
    logical = [spec.unpack(p).astype(F) for spec, p in zip(plan.specs, packed, strict=True)]
    assert_equal(read_output(out, kernels.layout), plan.run(logical))
    assert launcher.calls == [
        "aiodla_detect_reset", "aiodla_detect_decode", "aiodla_detect_rank",
        "aiodla_detect_mask", "aiodla_detect_select",
    ]  # fmt: skip
