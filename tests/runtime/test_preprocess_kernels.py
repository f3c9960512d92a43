"""The fused pre-processing kernels without a GPU: the generated source built as host C++
(one host thread per CUDA thread) and run through ``PreprocessKernels.launch`` itself (a
fake toolchain loads names, a fake launcher calls the host build with the very
parameter block ``cuLaunchKernel`` would get), compared byte for byte with
``spec.pack(pre.apply(frame, spec))``; the NVRTC compile for the GPUs aiodla targets;
and the errors."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from host_kernels import HostLauncher, build_host_library, nvrtc_cubin

from aiodla import ImagePreprocess
from aiodla._errors import ConfigurationError, RuntimeUnavailableError
from aiodla._preprocess import _axis
from aiodla._tensors import TensorSpec
from aiodla.runtime import _conversion_kernels as ck
from aiodla.runtime import _preprocess_kernels as pk
from aiodla.runtime import _preprocess_source as ps
from aiodla.runtime._conversion_source import BLOCK
from aiodla.runtime._preprocess_kernels import PreprocessKernels, preprocess_source
from aiodla.runtime._protocol import CudaCallError

from support import FakeToolchain

# Compiling (g++ for the host build, NVRTC) is CPU-bound: beside another suite on a
# 2-CPU machine one build passed the 60 s default meant to catch hangs.
pytestmark = pytest.mark.timeout(600)

IMAGENET = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
FULL_HD = (1080, 1920)
# Frame sizes per resize mode: 1080p and odd downscales, an upscale, a single pixel;
# nv12 takes even sizes only.
RESIZED = [FULL_HD, (271, 483), (17, 23), (1, 1)]
RESIZED_NV12 = [FULL_HD, (270, 482), (16, 22), (2, 2)]


def target(
    name: str, shape: tuple[int, int], dtype: str, fmt: str, qscale: float | None = None, **pre: Any
) -> tuple[TensorSpec, ImagePreprocess]:
    spec = TensorSpec(name, (1, 3, *shape), dtype, fmt, scale=qscale)
    return spec, ImagePreprocess(**pre)


# (spec, preprocess, frame sizes): every source, both orders, the three resize modes,
# float16 chw16, float32 nchw, int8 chw32 and uint8 hwc4 (quantized, saturating), and
# float16 nhwc for the kernel's unaligned path.
CASES = [
    (*target("bgr_chw16", (48, 64), "float16", "chw16", source="bgr", order="rgb",
             resize="letterbox", **IMAGENET), RESIZED),
    (*target("rgb_nchw", (37, 53), "float32", "nchw", source="rgb", order="bgr",
             resize="stretch", mean=(10.0, 20.0, 30.0), std=(2.0, 3.0, 0.5), scale=1.0),
     RESIZED),
    (*target("bgra_chw32", (45, 31), "int8", "chw32", 0.0123, source="bgra", order="rgb",
             resize="letterbox", pad_value=0, mean=0.5, std=(0.25, 0.3, 0.2)), RESIZED),
    (*target("rgba_hwc4", (40, 56), "uint8", "hwc4", 1 / 255, source="rgba", order="bgr",
             resize=None), [(40, 56)]),
    (*target("bgr_none", (33, 47), "float16", "chw16", source="bgr", order="bgr",
             resize=None, **IMAGENET), [(33, 47)]),
    (*target("nv12_chw16", (48, 64), "float16", "chw16", source="nv12", order="rgb",
             resize="letterbox", **IMAGENET), RESIZED_NV12),
    (*target("nv12_nhwc", (29, 41), "float16", "nhwc", source="nv12", order="bgr",
             resize="stretch", pad_value=255), RESIZED_NV12),
    (*target("nv12_chw32", (36, 50), "int8", "chw32", 0.03, source="nv12", order="rgb",
             resize=None, mean=(0.2, 0.5, 0.7), std=0.5), [(36, 50)]),
    (*target("rgb_hwc4", (24, 80), "uint8", "hwc4", 0.5 / 255, source="rgb", order="rgb",
             resize="letterbox", pad_value=200), RESIZED),
    # i420 heights that are not multiples of 4 too: a chroma row then starts mid-row
    (*target("i420_chw16", (48, 64), "float16", "chw16", source="i420", order="rgb",
             resize="letterbox", **IMAGENET), [*RESIZED_NV12, (6, 10), (18, 4)]),
    (*target("i420_nhwc", (29, 41), "float16", "nhwc", source="i420", order="bgr",
             resize="stretch", pad_value=255), RESIZED_NV12),
    (*target("i420_chw32", (38, 50), "int8", "chw32", 0.03, source="i420", order="rgb",
             resize=None, mean=(0.2, 0.5, 0.7), std=0.5), [(38, 50)]),
    # full-range YUV (an MJPEG camera's): its own coefficients
    (*target("i420_full", (48, 64), "float16", "chw16", source="i420", order="rgb",
             resize="letterbox", color_range="full", **IMAGENET), [*RESIZED_NV12, (6, 10)]),
    (*target("nv12_full", (29, 41), "float32", "nchw", source="nv12", order="bgr",
             resize="stretch", color_range="full"), RESIZED_NV12),
]  # fmt: skip


def host_build(tmp_path: Path, program: ps.PreprocessProgram) -> ctypes.CDLL:
    arguments = ", ".join(
        f"*({ps._TYPES.get(name, 'i64')}*)p[{i}]" for i, name in enumerate(ps.PARAMETERS)
    )
    runners = [
        # the parameter block as cuLaunchKernel reads it: an array of argument pointers
        f'extern "C" void run_{plan.name}(unsigned grid, void** p) {{\n'
        "  for (unsigned g = 0; g < grid; ++g) for (unsigned t = 0; t < BLOCK; ++t) {\n"
        f"    blockIdx = {{g, 0, 0}}; threadIdx = {{t, 0, 0}}; {plan.name}({arguments}); }}\n}}\n"
        for plans in program.kernels.values()
        for plan in plans
    ]
    # one axis's sample table, for test_sample_tables
    runners.append(
        'extern "C" void run_taps(i32 m, i32 n, u64 sig, i64 e, i32* i0, i32* i1, float* f) {\n'
        "  for (i32 d = 0; d < n; ++d) { const Tap t = tap(d, m, sig, (i32)e);\n"
        "    i0[d] = t.i0; i1[d] = t.i1; f[d] = t.f; }\n}\n"
    )
    return build_host_library(tmp_path, "preprocess", program.source, "".join(runners))


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreprocessKernels, Any]:
    """Every case in one program, compiled through PreprocessKernels.compile (fake NVRTC)
    and launched through its launch (host build): one g++ run for the module."""
    targets = [(spec, pre) for spec, pre, _ in CASES]
    library = host_build(tmp_path_factory.mktemp("host"), ps.plan_preprocess(targets))
    toolchain = FakeToolchain()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ck, "_toolchain", lambda device: toolchain)
        kernels = PreprocessKernels.compile(targets, cache_dir=tmp_path_factory.mktemp("cache"))
    launcher = HostLauncher(library)
    kernels._launcher = launcher
    return kernels, launcher


def frame_for(pre: ImagePreprocess, size: tuple[int, int], rng: np.random.Generator) -> Any:
    """A random frame, as a view whose rows are further apart than their bytes (pitch)."""
    height, width = size
    planar = pre.source in ("nv12", "i420")
    rows, row = (height * 3 // 2, width) if planar else (height, width)
    channels = {"nv12": 1, "i420": 1, "bgr": 3, "rgb": 3}.get(pre.source, 4)
    big = rng.integers(0, 256, (rows, row * channels + 13), np.uint8)
    view = big[:, : row * channels]
    return view if planar else view.reshape(rows, row, channels)


def run_host(
    kernels: PreprocessKernels, spec: TensorSpec, frame: Any, size: tuple[int, int], offset: int
) -> bytes:
    """The kernel's bytes, written at ``offset`` into a poisoned buffer (which must stay
    poisoned around them)."""
    out = np.full(spec.size + 64, 0xAB, np.uint8)
    start = -out.ctypes.data % 16 + offset  # 16-byte aligned, plus the offset
    kernels.launch(spec, frame.ctypes.data, *size, frame.strides[0], out.ctypes.data + start, 0)
    assert (out[:start] == 0xAB).all() and (out[start + spec.size :] == 0xAB).all()
    return out[start : start + spec.size].tobytes()


CASE_IDS = [spec.name for spec, _, _ in CASES]


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_host_build_matches_numpy(host_kernels: tuple[PreprocessKernels, Any], case: int) -> None:
    kernels, launcher = host_kernels
    spec, pre, sizes = CASES[case]
    rng = np.random.default_rng(case)
    for size in sizes:
        frame = frame_for(pre, size, rng)
        expected = spec.pack(pre.apply(frame, spec)).tobytes()
        assert run_host(kernels, spec, frame, size, 0) == expected, size
        assert launcher.calls[-1].endswith("_v16")
        # element stores, for a buffer that is not 16-byte aligned
        assert run_host(kernels, spec, frame, size, spec.numpy_dtype.itemsize) == expected, size
        assert not launcher.calls[-1].endswith("_v16")


@pytest.mark.parametrize("case", [1, 5, 9], ids=["packed", "nv12", "i420"])
def test_host_build_many_frame_sizes(
    host_kernels: tuple[PreprocessKernels, Any], case: int
) -> None:
    """The sample tables, computed on the device per launch, on many ratios (up and down,
    coprime sizes, exact multiples), one frame size after another through one kernel."""
    kernels, _ = host_kernels
    spec, pre, _ = CASES[case]
    rng = np.random.default_rng(100 + case)
    height, width = spec.shape[2:]
    sizes = [(height * 3, width * 3), (height // 2, width * 2), (height, width)]
    sizes += [tuple(int(s) for s in rng.integers(1, 160, 2)) for _ in range(12)]
    for size in sizes:
        if pre.source in ("nv12", "i420"):
            size = (size[0] + size[0] % 2, size[1] + size[1] % 2)
        frame = frame_for(pre, size, rng)
        expected = spec.pack(pre.apply(frame, spec)).tobytes()
        assert run_host(kernels, spec, frame, size, 0) == expected, size


def test_sample_tables(host_kernels: tuple[PreprocessKernels, Any]) -> None:
    """The kernel's integer sample tables equal numpy's binary64 ones (``_axis``) on every
    axis from 1..96 pixels to 1..96, and on random ones up to 16384 either way."""
    library = host_kernels[1].library
    rng = np.random.default_rng(5)
    pairs = [(m, n) for m in range(1, 97) for n in range(1, 97)]
    pairs += [(int(m), int(n)) for m, n in rng.integers(1, 16385, (300, 2))]
    pairs += [(16384, 1), (1, 16384), (16384, 16383), (1080, 640), (1920, 640), (3, 16384)]
    for m, n in pairs:
        i0, i1 = np.empty(n, np.int32), np.empty(n, np.int32)
        f = np.empty(n, np.float32)
        significand, exponent = pk._split(m / n)
        library.run_taps(
            ctypes.c_int32(m), ctypes.c_int32(n), ctypes.c_uint64(significand),
            ctypes.c_int64(exponent), *(ctypes.c_void_p(a.ctypes.data) for a in (i0, i1, f)),
        )  # fmt: skip
        expected = _axis(m, n)
        assert (i0 == expected[0]).all() and (i1 == expected[1]).all(), (m, n)
        assert f.tobytes() == expected[2].tobytes(), (m, n)


def test_saturation_and_canvas_are_exercised() -> None:
    """The int8 case reaches both ends of its range and the letterbox pads: a kernel that
    forgot to saturate or pad would not match by chance."""
    spec, pre, _ = CASES[2]
    frame = frame_for(pre, (271, 483), np.random.default_rng(2))
    values = spec.unpack(spec.pack(pre.apply(frame, spec)), dequantize=False)
    assert values.min() == -128 and values.max() == 127
    geometry = pre.geometry(271, 483, *spec.shape[2:])
    assert geometry.top > 0 or geometry.left > 0


# -- the source, the launch checks, the errors --------------------------------------------

SPEC, PRE = CASES[0][0], CASES[0][1]


def test_source_holds_one_pair_per_target() -> None:
    other = TensorSpec("other", (1, 3, 8, 8), "float32", "nchw")
    source = preprocess_source([(SPEC, PRE), (other, PRE), (SPEC, PRE)])
    for index in (0, 1):
        for vec in (16, SPEC.numpy_dtype.itemsize if index == 0 else 4):
            assert source.count(f" aiodla_preprocess_t{index}_v{vec}(") == 1
    assert "struct P2" not in source
    # the constants as float32 bits: mean[0] = 0.485 in the model's order
    assert f"MEAN0 = {int(np.float32(0.485).view(np.uint32)):#010x}u" in source


def test_refused_targets() -> None:
    with pytest.raises(ValueError, match="two different"):
        preprocess_source(
            [(SPEC, PRE), (SPEC, ImagePreprocess(source="rgb", order="rgb", resize=None))]
        )
    unscaled = TensorSpec("q", (1, 3, 8, 8), "int8", "chw32")
    with pytest.raises(ConfigurationError, match="quantization scale"):
        preprocess_source([(unscaled, PRE)])


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeToolchain:
    toolchain = FakeToolchain()
    monkeypatch.setattr(ck, "_toolchain", lambda device: toolchain)
    return toolchain


def test_cache_and_launch_arguments(fake: FakeToolchain, tmp_path: Path) -> None:
    first = PreprocessKernels.compile([(SPEC, PRE)], cache_dir=tmp_path)
    second = PreprocessKernels.compile([(SPEC, PRE)], cache_dir=tmp_path)
    assert not first.compiled_from_cache and second.compiled_from_cache and fake.compiled == 1
    calls: list[tuple[Any, ...]] = []
    second._launcher = lambda *args: calls.append(args) or (0,)
    second.launch(SPEC, 0x1000, 1080, 1920, 5760, 0x2000, 9)
    function, grid, *_, stream, params, _extra = calls[0]
    assert function == "fn:aiodla_preprocess_t0_v16" and stream == 9
    assert grid == -(-SPEC.size // (16 * BLOCK))
    # the parameter block: pointers to thirteen 8-byte arguments
    pointers = (ctypes.c_void_p * 13).from_address(params)
    values = [ctypes.c_int64.from_address(pointer).value for pointer in pointers]
    geometry = PRE.geometry(1080, 1920, 48, 64)
    assert values[:9] == [0x1000, 0x2000, 5760, 1080, 1920, geometry.top, geometry.left, 36, 64]
    # 1080 / 36 and 1920 / 64, as significand * 2**exponent
    assert values[9] * 2.0 ** values[10] == 30.0 and values[11] * 2.0 ** values[12] == 30.0
    assert 2**52 <= values[9] < 2**53 and 2**52 <= values[11] < 2**53


def test_launch_refusals(fake: FakeToolchain, tmp_path: Path) -> None:
    nv12 = TensorSpec("n", (1, 3, 8, 8), "float16", "chw16")
    exact = TensorSpec("e", (1, 3, 8, 8), "float32", "nchw")
    kernels = PreprocessKernels.compile(
        [
            (SPEC, PRE),
            (nv12, ImagePreprocess(source="nv12", order="rgb", resize="stretch")),
            (exact, ImagePreprocess(source="rgb", order="rgb", resize=None)),
        ],
        cache_dir=tmp_path,
    )
    kernels._launcher = lambda *args: (0,)
    with pytest.raises(ValueError, match="larger than max_frame"):
        kernels.launch(SPEC, 0, 1081, 1081, 8000, 0, 0)
    with pytest.raises(ValueError, match="larger than max_frame"):
        kernels.launch(SPEC, 0, 1921, 10, 8000, 0, 0)
    with pytest.raises(ValueError, match="larger than max_frame"):
        kernels.launch(SPEC, 0, 0, 10, 30, 0, 0)
    with pytest.raises(ValueError, match="integers"):
        kernels.launch(SPEC, 0, 10.5, 10, 30, 0, 0)
    with pytest.raises(ValueError, match="pitch of 29 bytes"):
        kernels.launch(SPEC, 0, 10, 10, 29, 0, 0)
    with pytest.raises(ValueError, match="unaligned"):
        kernels.launch(SPEC, 0, 10, 10, 30, 0x1001, 0)
    with pytest.raises(ValueError, match="even height and width"):
        kernels.launch(nv12, 0, 10, 11, 12, 0, 0)
    with pytest.raises(ValueError, match="model's 8x8"):
        kernels.launch(exact, 0, 8, 9, 27, 0, 0)
    kernels.launch(nv12, 0, 10, 12, 12, 0, 0)  # nv12 rows are W bytes
    kernels.launch(exact, 0, 8, 8, 24, 4, 0)  # element stores
    with pytest.raises(ValueError, match=r"'x' \(compiled: bgr_chw16, n, e\)"):
        kernels.launch(TensorSpec("x", (1, 3, 8, 8), "float32", "nchw"), 0, 8, 8, 24, 0, 0)


def test_launch_error_is_a_cuda_call_error(fake: FakeToolchain, tmp_path: Path) -> None:
    kernels = PreprocessKernels.compile([(SPEC, PRE)], cache_dir=tmp_path)
    kernels._launcher = lambda *args: (700,)
    with pytest.raises(CudaCallError) as info:
        kernels.launch(SPEC, 0, 10, 10, 30, 0, 0)
    assert info.value.code == 700


def test_compile_and_load_failures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Broken(FakeToolchain):
        def compile(self, source: str, arch: str) -> bytes:
            raise RuntimeUnavailableError("NVRTC could not compile: log: error: x")

    class Unloadable(FakeToolchain):
        def load(self, cubin: bytes, names: Any) -> dict[str, Any]:
            raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(ck, "_toolchain", lambda device: Broken())
    with pytest.raises(RuntimeUnavailableError, match="NVRTC could not compile"):
        PreprocessKernels.compile([(SPEC, PRE)], cache_dir=tmp_path)
    monkeypatch.setattr(ck, "_toolchain", lambda device: Unloadable())
    with pytest.raises(RuntimeUnavailableError, match="pre-processing kernels compiled for sm_90"):
        PreprocessKernels.compile([(SPEC, PRE)], cache_dir=tmp_path)
    assert not list(tmp_path.glob("*"))


def test_missing_cuda_core_is_runtime_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "cuda.core" or m.startswith("cuda.core.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cuda.core", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "cuda.core.experimental", None)
    with pytest.raises(RuntimeUnavailableError, match=r"cuda\.core.*pip install cuda-core"):
        PreprocessKernels.compile([(SPEC, PRE)], cache_dir=Path("/nonexistent"))


@pytest.mark.parametrize("arch", ["sm_87", "sm_90"])
def test_nvrtc_compiles(arch: str) -> None:
    """No GPU needed: a source NVRTC refuses never reaches a Jetson (sm_87, Orin) or the
    H200 (sm_90) the GPU tests run on."""
    detector = target("images", (640, 640), "float16", "chw16", source="bgr", order="rgb",
                      resize="letterbox", **IMAGENET)  # fmt: skip
    targets = [detector] + [(spec, pre) for spec, pre, _ in CASES]
    cubin = nvrtc_cubin(preprocess_source(targets), arch, "aiodla_preprocess")
    for spec, _ in targets[:3]:
        index = [s for s, _ in targets].index(spec)
        assert f"aiodla_preprocess_t{index}_v16".encode() in cubin
