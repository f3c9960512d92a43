"""The GPU conversion kernels without a GPU: the generated source, the cache directory,
the disk cache (with a fake compiler), the errors; and, where a host C++ compiler
exists, the kernels themselves built as host code (one host thread per CUDA thread)
and compared byte for byte with ``TensorSpec.pack`` / ``unpack``."""

from __future__ import annotations

import ctypes
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from host_kernels import build_host_library

from aiodla import _descriptors
from aiodla._errors import RuntimeUnavailableError
from aiodla._tensors import TensorSpec
from aiodla.runtime import _cache
from aiodla.runtime import _conversion_kernels as ck
from aiodla.runtime import _conversion_source as cs

from support import FakeToolchain

# Compiling (g++ for the host build, NVRTC) is CPU-bound: beside another suite on a
# 2-CPU machine one build passed the 60 s default meant to catch hangs.
pytestmark = pytest.mark.timeout(600)

FORMATS = ("nchw", "nhwc", "chw16", "chw32", "hwc4")
PAIRS = [(f, d) for f in FORMATS for d in sorted(_descriptors._ACCEPTED_DTYPES[f])]
SCALE = 0.0123


def spec_for(fmt: str, dtype: str, *, padded: bool = False, c: int = 3) -> TensorSpec:
    esize = np.dtype(dtype).itemsize
    n, h, w = 2, 3, 5
    c = min(c, 4) if fmt == "hwc4" else c
    scale = SCALE if np.dtype(dtype).kind in "iu" else None
    if not padded:
        return TensorSpec("t", (n, c, h, w), dtype, fmt, scale=scale)
    lanes = {"nchw": 1, "chw16": 16, "chw32": 32, "hwc4": 4}.get(fmt, c + 2)
    pixel = lanes * esize
    groups = -(-c // lanes)
    line = w * pixel + 3 * esize
    surface = h * line + 5 * esize
    batch = groups * surface + 16
    extent = (n - 1) * batch + (groups - 1) * surface + (h - 1) * line + w * pixel
    strides = (pixel, line, surface, batch)
    return TensorSpec(
        "t", (n, c, h, w), dtype, fmt, strides=strides, nbytes=extent + 7, scale=scale
    )


def sources_for(spec: TensorSpec) -> list[np.dtype[Any]]:
    if spec.is_integer:
        floats = ["float64", "float32", "float16"]
        ints = [
            d for d in ("bool", "int8", "uint8", "int16", "uint16") if np.can_cast(d, spec.dtype)
        ]
        return [np.dtype(d) for d in floats + ints]
    return list(cs.KIND_NAMES)


def results_for(spec: TensorSpec) -> list[np.dtype[Any]]:
    out = [spec.numpy_dtype]
    if spec.is_integer:
        out += [np.dtype("float32"), np.dtype("float16"), np.dtype("float64")]
    elif spec.dtype == "float16":
        out += [np.dtype("float32"), np.dtype("float64")]
    else:
        out += [np.dtype("float64")]
    return out


def constant(source: str, struct: int, name: str) -> str:
    body = re.search(rf"struct T{struct} \{{(.*?)\n\}};", source, re.S)
    assert body is not None, f"no traits struct T{struct}"
    found = re.search(rf"\b{name} = ([^,;]+)[,;]", body.group(1))
    assert found is not None, f"T{struct} has no {name}"
    return found.group(1)


class TestSource:
    @pytest.mark.parametrize(("fmt", "dtype"), PAIRS)
    @pytest.mark.parametrize("padded", [False, True])
    def test_constants_are_the_specs(self, fmt: str, dtype: str, padded: bool) -> None:
        spec = spec_for(fmt, dtype, padded=padded)
        packs = [(spec, d) for d in sources_for(spec)]
        unpacks = [(spec, d) for d in results_for(spec)]
        source = ck.kernel_source(packs, unpacks)
        assert spec.strides is not None
        expected = dict(zip(("PIXEL", "LINE", "SURFACE", "BATCH"), spec.strides))
        expected.update(N=spec.shape[0], C=spec.shape[1], H=spec.shape[2], W=spec.shape[3])
        expected.update(SIZE=spec.size, LANES=spec.lanes, GROUPS=spec.groups)
        expected.update(ESIZE=spec.numpy_dtype.itemsize)
        for name, value in expected.items():
            assert int(constant(source, 0, name)) == value, name
        assert constant(source, 0, "KIND") == "K_" + cs.KIND_NAMES[spec.numpy_dtype]
        # one traits struct however many pairs, and one kernel (two for pack) per pair
        assert source.count("struct T0 {") == 1 and "struct T1 " not in source
        program = cs.plan_program(packs, unpacks)
        for plans in program.packs.values():
            for plan in plans:
                assert source.count(f" {plan.name}(") == 1
        for plan in program.unpacks.values():
            assert source.count(f" {plan.name}(") == 1
        assert len(program.packs) == len(set(packs)) and len(program.unpacks) == len(unpacks)

    @pytest.mark.parametrize("scale", [0.0123, 2.0**-7, 1 / 3, 5e-300, 3.0, 0.1])
    def test_scale_literal_is_exact(self, scale: float) -> None:
        spec = TensorSpec("q", (1, 40, 2, 2), "int8", "chw32", scale=scale)
        source = ck.kernel_source([(spec, np.float32)], [(spec, np.float32)])
        assert float.fromhex(constant(source, 0, "SCALE")) == scale
        pow2 = scale in (2.0**-7,)
        assert constant(source, 0, "MUL") == str(pow2).lower()
        by = float.fromhex(constant(source, 0, "BY"))
        assert by == (1 / scale if pow2 else scale)
        assert (
            float.fromhex(constant(source, 0, "QLO")),
            float.fromhex(constant(source, 0, "QHI")),
        ) == (-128.0, 127.0)

    def test_name_cannot_break_the_source(self) -> None:
        spec = TensorSpec("evil\\\nname*/", (1, 1, 1, 1), "float16", "nchw")
        source = ck.kernel_source([(spec, np.float32)], [])
        line = next(text for text in source.splitlines() if text.startswith("struct T0"))
        assert "\\" not in line and "evil" in line

    def test_refused_pairs(self) -> None:
        unscaled = TensorSpec("u", (1, 3, 2, 2), "int8", "nchw")
        with pytest.raises(ValueError, match="needs a scale"):
            ck.kernel_source([(unscaled, np.float32)], [])
        with pytest.raises(ValueError, match="cast safely"):
            ck.kernel_source([(unscaled, np.int16)], [])
        with pytest.raises(ValueError, match="cast safely"):
            ck.kernel_source([], [(unscaled, np.uint8)])
        with pytest.raises(ValueError, match="no pack kernel reads"):
            ck.kernel_source([(unscaled, np.int64)], [])
        odd = TensorSpec("o", (1, 1, 2, 2), "float16", "nchw", strides=(2, 5, 11, 22))
        with pytest.raises(ValueError, match="not multiples"):
            ck.kernel_source([(odd, np.float16)], [])


class TestCacheDir:
    def test_explicit(self, tmp_path: Path) -> None:
        env = {"AIODLA_CACHE_DIR": str(tmp_path / "k"), "XDG_CACHE_HOME": "/x"}
        assert ck.kernel_cache_dir(env) == tmp_path / "k" / "kernels"

    def test_xdg(self) -> None:
        assert ck.kernel_cache_dir({"XDG_CACHE_HOME": "/var/c"}) == Path("/var/c/aiodla/kernels")
        assert ck.kernel_cache_dir({"AIODLA_CACHE_DIR": "", "XDG_CACHE_HOME": "/c"}) == Path(
            "/c/aiodla/kernels"
        )

    def test_one_setting_for_every_cache(self, tmp_path: Path) -> None:
        # The kernels' own variable of old is not a second setting.
        env = {"AIODLA_KERNEL_CACHE": str(tmp_path / "k"), "XDG_CACHE_HOME": "/x"}
        assert ck.kernel_cache_dir(env) == Path("/x/aiodla/kernels")

    def test_home(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.setenv("HOME", str(tmp_path))
        expected = tmp_path / ".cache" / "aiodla" / "kernels"
        assert ck.kernel_cache_dir({}) == expected
        assert ck.kernel_cache_dir({"XDG_CACHE_HOME": "relative/path"}) == expected
        monkeypatch.delenv("AIODLA_CACHE_DIR", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        assert ck.kernel_cache_dir() == expected


SPEC = TensorSpec("img", (1, 3, 8, 8), "float16", "chw16")


class TestCompileAndCache:
    def compile(self, cache: Path) -> ck.ConversionKernels:
        return ck.ConversionKernels.compile(
            [(SPEC, np.dtype(np.float32))], [(SPEC, np.dtype(np.float16))], cache_dir=cache
        )

    def test_second_open_reads_the_cache(
        self, fake_toolchain: FakeToolchain, tmp_path: Path
    ) -> None:
        first = self.compile(tmp_path)
        assert not first.compiled_from_cache and fake_toolchain.compiled == 1
        (entry,) = tmp_path.glob("*.cubin")
        assert not list(tmp_path.glob("*.tmp"))  # the temp file was renamed
        second = self.compile(tmp_path)
        assert second.compiled_from_cache and fake_toolchain.compiled == 1
        assert fake_toolchain.loaded[0] == fake_toolchain.loaded[1]
        assert "from cache" in repr(second)
        # another source (another spec) is another entry
        other = TensorSpec("img", (1, 3, 8, 9), "float16", "chw16")
        ck.ConversionKernels.compile([(other, np.dtype(np.float32))], [], cache_dir=tmp_path)
        assert fake_toolchain.compiled == 2 and len(list(tmp_path.glob("*.cubin"))) == 2
        assert entry.exists()

    @pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage-with-good-sum"])
    def test_corrupt_entry_is_recompiled(
        self, fake_toolchain: FakeToolchain, tmp_path: Path, damage: str
    ) -> None:
        self.compile(tmp_path)
        (entry,) = tmp_path.glob("*.cubin")
        data = bytearray(entry.read_bytes())
        if damage == "flip":
            data[-1] ^= 1
        elif damage == "truncate":
            data = data[:20]
        elif damage == "empty":
            data = bytearray()
        else:  # a consistent checksum over bytes the loader refuses
            import hashlib

            body = b"NOT A CUBIN"
            data = bytearray(_cache._MAGIC + hashlib.sha256(body).digest() + body)
        entry.write_bytes(bytes(data))
        kernels = self.compile(tmp_path)
        assert not kernels.compiled_from_cache and fake_toolchain.compiled == 2
        assert _cache.read_entry(entry) == fake_toolchain.loaded[-1]  # rewritten, whole again

    def test_unwritable_cache_still_compiles(
        self, fake_toolchain: FakeToolchain, tmp_path: Path
    ) -> None:
        blocker = tmp_path / "file"
        blocker.write_text("not a directory")
        assert not self.compile(blocker / "sub").compiled_from_cache

    def test_uncompiled_pair_is_a_value_error(
        self, fake_toolchain: FakeToolchain, tmp_path: Path
    ) -> None:
        calls: list[tuple[Any, ...]] = []
        kernels = self.compile(tmp_path)
        kernels._launcher = lambda *args: calls.append(args) or (0,)
        with pytest.raises(ValueError, match=r"'img' from float64.*img/float32"):
            kernels.pack(SPEC, np.dtype(np.float64), 0, (1, 1, 1, 1), 0, 0)
        with pytest.raises(ValueError, match=r"'img' into float32"):
            kernels.unpack(SPEC, np.dtype(np.float32), 0, 0, 0)
        kernels.pack(SPEC, np.dtype(np.float32), 4096, (192, 64, 8, 1), 8192, 7)
        kernels.pack(SPEC, np.dtype(np.float32), 4096, (192, 64, 8, 1), 8194, 7)
        vector, element = calls[0][0], calls[1][0]
        assert vector.endswith("_v16") and element.endswith("_v2")
        assert calls[0][1] == -(-SPEC.size // (16 * cs.BLOCK))  # the vector kernel's grid
        assert calls[0][4] == cs.BLOCK and calls[0][8] == 7
        with pytest.raises(ValueError, match="unaligned"):
            kernels.pack(SPEC, np.dtype(np.float32), 4098, (192, 64, 8, 1), 8192, 7)

    def test_launch_error_is_a_cuda_call_error(
        self, fake_toolchain: FakeToolchain, tmp_path: Path
    ) -> None:
        from aiodla.runtime._protocol import CudaCallError

        kernels = self.compile(tmp_path)
        kernels._launcher = lambda *args: (700,)
        with pytest.raises(CudaCallError) as info:
            kernels.unpack(SPEC, np.dtype(np.float16), 0, 0, 3)
        assert info.value.code == 700 and info.value.sticky

    def test_compile_failure_message(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        class Broken(FakeToolchain):
            def compile(self, source: str, arch: str) -> bytes:
                raise RuntimeUnavailableError("NVRTC could not compile: log: error: x")

        monkeypatch.setattr(ck, "_toolchain", lambda device: Broken())
        with pytest.raises(RuntimeUnavailableError, match="NVRTC could not compile"):
            self.compile(tmp_path)
        assert not list(tmp_path.glob("*"))


def test_missing_cuda_core_is_runtime_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "cuda.core" or m.startswith("cuda.core.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cuda.core", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "cuda.core.experimental", None)
    with pytest.raises(RuntimeUnavailableError, match=r"cuda\.core.*pip install cuda-core"):
        ck.ConversionKernels.compile([(SPEC, np.float32)], [], cache_dir=Path("/nonexistent"))


# -- the kernels as host C++ ----------------------------------------------------------


def host_library(tmp_path: Path, program: cs.Program) -> ctypes.CDLL:
    runners = []
    for plans in program.packs.values():
        for plan in plans:
            runners.append(
                f'extern "C" void run_{plan.name}(const void* s, void* d, i64 a, i64 b, i64 c, i64 e) {{\n'
                f"  for (unsigned g = 0; g < {plan.grid}; ++g) for (unsigned t = 0; t < BLOCK; ++t) {{\n"
                f"    blockIdx = {{g, 0, 0}}; threadIdx = {{t, 0, 0}}; {plan.name}(s, d, a, b, c, e); }}\n}}\n"
            )
    for plan in program.unpacks.values():
        runners.append(
            f'extern "C" void run_{plan.name}(const void* s, void* d) {{\n'
            f"  for (unsigned g = 0; g < {plan.grid}; ++g) {{\n"
            "    std::barrier<> bar(BLOCK); block_barrier = &bar; std::vector<std::thread> ts;\n"
            "    for (unsigned t = 0; t < BLOCK; ++t) ts.emplace_back([=] {\n"
            f"      blockIdx = {{g, 0, 0}}; threadIdx = {{t, 0, 0}}; {plan.name}(s, d); }});\n"
            "    for (auto& th : ts) th.join();\n  }\n}\n"
        )
    return build_host_library(tmp_path, "kernels", program.source, "".join(runners))


def values_for(
    spec: TensorSpec, dtype: np.dtype[Any], rng: np.random.Generator
) -> np.ndarray[Any, Any]:
    count = int(np.prod(spec.shape))
    if dtype.kind == "f":
        specials = [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            65504.0,
            65519.0,
            65520.0,
            2.0**-24,
            2.0**-25,
            3e-8,
            SCALE * 2.5,
            -SCALE * 0.5,
            1e6,
            -1e6,
        ]
        values = rng.standard_normal(count) * 4
        values[: len(specials)] = specials[:count]
        with np.errstate(over="ignore"):
            array = values.astype(dtype)
        if not spec.is_integer:
            bits = {2: 0x7D01, 4: 0x7FA00001, 8: 0x7FF4000000000001}[dtype.itemsize]
            array.reshape(-1).view(f"u{dtype.itemsize}")[-1] = bits  # a signaling NaN
        return array.reshape(spec.shape)
    info = np.iinfo(dtype) if dtype.kind in "iu" else None
    low, high = (info.min, info.max) if info else (0, 1)
    return rng.integers(low, high, count, endpoint=True).astype(dtype).reshape(spec.shape)


CASES = [(fmt, dtype, padded) for fmt, dtype in PAIRS for padded in (False, True)]


def case_spec(fmt: str, dtype: str, padded: bool) -> TensorSpec:
    return spec_for(fmt, dtype, padded=padded, c=17 if fmt in ("chw16", "nhwc") else 3)


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory: pytest.TempPathFactory) -> tuple[cs.Program, ctypes.CDLL]:
    """Every case's kernels in one program, as an engine compiles them: one build."""
    packs, unpacks = [], []
    for case in CASES:
        spec = case_spec(*case)
        packs += [(spec, d) for d in sources_for(spec)]
        unpacks += [(spec, d) for d in results_for(spec)]
    program = cs.plan_program(packs, unpacks)
    return program, host_library(tmp_path_factory.mktemp("host"), program)


@pytest.mark.parametrize(("fmt", "dtype", "padded"), CASES)
def test_kernels_as_host_code_match_numpy(
    host_kernels: tuple[cs.Program, ctypes.CDLL], fmt: str, dtype: str, padded: bool
) -> None:
    program, library = host_kernels
    spec = case_spec(fmt, dtype, padded)
    rng = np.random.default_rng(7)
    for source in sources_for(spec):
        vector, element = program.packs[(spec, source)]
        array = values_for(spec, source, rng)
        # a strided view: channels reversed, a transposed base
        base = np.ascontiguousarray(array[:, ::-1].transpose(0, 2, 3, 1))
        view = base.transpose(0, 3, 1, 2)[:, ::-1]
        strides = tuple(s // source.itemsize for s in view.strides)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = spec.pack(array, validate=False)
        for plan in (vector, element):
            out = np.full(spec.size + 16, 0xAB, np.uint8)
            getattr(library, f"run_{plan.name}")(
                ctypes.c_void_p(view.ctypes.data),
                ctypes.c_void_p(out.ctypes.data),
                *map(ctypes.c_int64, strides),
            )
            assert out[spec.size :].tolist() == [0xAB] * 16, "wrote past the buffer"
            assert out[: spec.size].tobytes() == expected.tobytes(), (plan.name, source)
    raw = np.frombuffer(rng.bytes(spec.size), np.uint8).copy()
    for result in results_for(spec):
        plan = program.unpacks[(spec, result)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = spec.unpack(raw, dequantize=result.kind == "f", dtype=result)
        out = np.zeros(spec.shape, result)
        getattr(library, f"run_{plan.name}")(
            ctypes.c_void_p(raw.ctypes.data), ctypes.c_void_p(out.ctypes.data)
        )
        assert out.tobytes() == expected.tobytes(), (plan.name, result)


def test_nan_into_an_integer_tensor_stores_zero_as_numpy_does(
    host_kernels: tuple[cs.Program, ctypes.CDLL],
) -> None:
    program, library = host_kernels
    spec = case_spec("chw32", "int8", False)
    source = np.dtype("float32")
    values = np.resize(np.array([np.nan, 0.5, -np.nan, 1e9, -7.0], np.float32), spec.shape)
    expected = spec.bind(np.zeros(spec.size, np.uint8))
    expected.write(values, checked=True)  # the conversion's own rule, no host NaN check
    for plan in program.packs[(spec, source)]:
        out = np.full(spec.size, 0xAB, np.uint8)
        getattr(library, f"run_{plan.name}")(
            ctypes.c_void_p(values.ctypes.data),
            ctypes.c_void_p(out.ctypes.data),
            *map(ctypes.c_int64, (s // 4 for s in values.strides)),
        )
        assert out.tobytes() == expected.raw.tobytes(), plan.name
    assert not np.isnan(spec.unpack(expected.raw)).any()
