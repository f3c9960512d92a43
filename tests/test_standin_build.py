"""The GPU stand-in's source builds with nvcc, and the library it makes is what cuDLA
users load: SONAME libcudla.so.1, the 13 entry points and the controls exported, the
static CUDA runtime's own symbols hidden.

No GPU is needed: the library loads (its CUDA runtime is linked statically and reaches
the driver only when first used), and its host-only helpers run the very parser and
task arithmetic the kernel uses, so they are held here to the emulated runtime's bytes
and to the Python parser's verdicts.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cuda.bindings import cudla

from aiodla._errors import ConfigurationError, ModelError
from aiodla.emulator import _standin
from aiodla.emulator._format import parse_loadable
from aiodla.emulator._ops import run_model
from aiodla.emulator._standin import (
    CONTROL_FUNCTIONS,
    CUDLA_ENTRY_POINTS,
    StandinControls,
    build_standin,
)

from vectors import SplitMix64, Vector, vectors

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason=f"{NVCC!r} is not installed")
VECTORS = vectors()
INVALID_MODULE = 12


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which(NVCC) is None:
        pytest.skip(f"{NVCC!r} is not installed")
    # nvcc's default target: this machine may have no GPU to detect.
    return build_standin(tmp_path_factory.mktemp("standin"), nvcc=NVCC, arch=None)


@pytest.fixture(scope="module")
def controls(tmp_path_factory: pytest.TempPathFactory) -> StandinControls:
    """The host-side helpers, from the host-fake build.

    Any library loaded under the SONAME libcudla.so.1, even RTLD_LOCAL, is what
    cuda.pathfinder hands cuda.bindings.cudla afterwards; so this process never loads
    the real build (its tests load it in a subprocess). The host-fake build is the
    same parser and task arithmetic under another SONAME.
    """
    if shutil.which(NVCC) is None:
        pytest.skip(f"{NVCC!r} is not installed")
    path = build_standin(tmp_path_factory.mktemp("hostfake"), nvcc=NVCC, host_fake=True)
    return StandinControls(ctypes.CDLL(str(path)))


_PROBE_REAL_BUILD = """
import ctypes, json, sys
from aiodla.emulator._standin import StandinControls, standin_loaded
lib = ctypes.CDLL(sys.argv[1])
controls = StandinControls(lib)
version, count = ctypes.c_uint64(), ctypes.c_uint64()
print(json.dumps({
    "version": [lib.cudlaGetVersion(ctypes.byref(version)), version.value],
    "count": [lib.cudlaDeviceGetCount(ctypes.byref(count)), count.value],
    "null": lib.cudlaGetVersion(None),
    "cores": controls.cores,
    "host_fake": controls.host_fake,
    "fake_alloc": lib.aiodlaStandinFakeAlloc(64),
    "loadable": controls.check_loadable(bytes.fromhex(sys.argv[2]))[0],
    "garbage": controls.check_loadable(b"garbage")[0],
    "context_error": controls.context_error,
    "loaded": standin_loaded(),
}))
"""


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} (binutils) is not installed")
    return path


class TestBuild:
    def test_file_and_soname(self, built: Path) -> None:
        assert built.name == "libcudla.so.1"
        assert built.is_file()
        dynamic = subprocess.run(
            [_tool("readelf"), "-d", str(built)], capture_output=True, text=True, check=True
        ).stdout
        assert "Library soname: [libcudla.so.1]" in dynamic
        # Static cudart: nothing to find on the loader path but the C/C++ runtimes.
        assert "libcudart" not in dynamic
        assert "libcuda.so" not in dynamic

    def test_exports(self, built: Path) -> None:
        listing = subprocess.run(
            [_tool("nm"), "-D", "--defined-only", str(built)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        exported = {line.split()[-1] for line in listing.splitlines() if line.strip()}
        assert set(CUDLA_ENTRY_POINTS) <= exported
        assert set(CONTROL_FUNCTIONS) <= exported
        # Only ours: the static CUDA runtime must not interpose on other libraries.
        assert exported == set(CUDLA_ENTRY_POINTS) | set(CONTROL_FUNCTIONS)

    def test_loads_without_a_gpu(self, built: Path) -> None:
        result = subprocess.run(
            [sys.executable, "-c", _PROBE_REAL_BUILD, str(built), VECTORS[0].loadable.hex()],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        facts = json.loads(result.stdout)
        assert facts["version"] == [0, 1_002_001]
        assert facts["count"] == [0, 2]
        assert facts["null"] == 1  # cudlaErrorInvalidParam
        assert facts["cores"] == 2
        assert facts["host_fake"] is False
        assert facts["fake_alloc"] is None  # a GPU build has no fake memory
        assert facts["loadable"] == 0
        assert facts["garbage"] == INVALID_MODULE
        assert facts["context_error"] == 0  # no CUDA call made, none lost
        assert facts["loaded"] is True  # found under its SONAME, as cuda.pathfinder looks

    def test_core_count_from_the_environment(self, built: Path) -> None:
        script = (
            "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "lib.aiodlaStandinCores.restype = ctypes.c_uint64; print(lib.aiodlaStandinCores())"
        )
        for value, expected in (("5", "5"), ("16", "16"), ("0", "2"), ("17", "2"), ("two", "2")):
            env = {**os.environ, "AIODLA_STANDIN_CORES": value}
            out = subprocess.run(
                [sys.executable, "-c", script, str(built)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            assert out == expected, value

    def test_fail_next_call_names_entry_points(self, controls: StandinControls) -> None:
        with pytest.raises(ConfigurationError):
            controls.fail_next_call("cudlaNoSuchCall", 1)
        assert controls.library.aiodlaStandinFailNextCall(b"cudlaNoSuchCall", 1) == 1
        # Injected and consumed without any GPU: the call returns the status once.
        controls.fail_next_call("cudlaGetVersion", 7)
        version = ctypes.c_uint64()
        assert controls.library.cudlaGetVersion(ctypes.byref(version)) == 7
        assert controls.library.cudlaGetVersion(ctypes.byref(version)) == 0

    def test_controls_reject_bad_cores(self, controls: StandinControls) -> None:
        with pytest.raises(ConfigurationError):
            controls.hang_core(controls.cores)
        with pytest.raises(ConfigurationError):
            controls.fail_next_task(-1)
        assert controls.library.aiodlaStandinHeldTasks(99) == -1
        assert controls.live_handles() == {"devices": 0, "modules": 0, "registrations": 0}
        assert controls.core_tasks(0) == 0
        assert controls.core_busy_time(0) == 0.0

    def test_fail_next_task_modes(self, controls: StandinControls) -> None:
        # Checked before anything is queued: nothing here reaches a task.
        with pytest.raises(ConfigurationError, match="status=0"):
            controls.fail_next_task(0, 0, on_stream=True)
        with pytest.raises(ConfigurationError, match="core="):
            controls.fail_next_task(controls.cores, on_stream=True)
        with pytest.raises(ValueError, match="not a valid Status"):
            controls.fail_next_task(0, 0x12345, on_stream=True)
        # The C entry point takes a mode of 0 or 1 only (cudlaErrorInvalidParam).
        assert controls.library.aiodlaStandinFailNextTask(0, 0x40000006, 2) == 1
        assert controls.library.aiodlaStandinFailNextTask(0, 0, 1) == 1
        assert controls.context_error == 0

    def test_host_fake_variant(self, controls: StandinControls) -> None:
        assert Path(controls.library._name).name == "libcudla-hostfake.so.1"
        assert controls.host_fake
        pointer = controls.fake_alloc(1000)
        assert pointer % 256 == 0
        controls.fake_free(pointer)
        with pytest.raises(cudla.CudlaError):  # freed already
            controls.fake_free(pointer)


class TestFaultOnTheStreamHostFake:
    """The sticky mode without a GPU: the child scenarios of
    tests/gpu/test_standin_faults_gpu.py on the host-fake build, whose faulting task
    loses its fake CUDA context (the GPU run repeats them on the real build, where the
    task's kernel traps). Each child checks what it sees and lists what went wrong."""

    @pytest.mark.parametrize("scenario", ["runtime", "engine"])
    def test_scenario(self, controls: StandinControls, scenario: str) -> None:
        child = Path(__file__).resolve().parent / "gpu" / "test_standin_faults_gpu.py"
        result = subprocess.run(
            [sys.executable, str(child), scenario, "--host-fake"],
            env={**os.environ, "AIODLA_STANDIN_LIB": str(controls.library._name)},
            capture_output=True,
            text=True,
            timeout=50,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["problems"] == [], report
        assert report["facts"]["context_error"] == 719  # cudaErrorLaunchFailure


class TestBuildErrors:
    def test_missing_compiler(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError, match="not found"):
            build_standin(tmp_path, nvcc="no-such-nvcc-here")

    def test_compiler_failure_is_reported(self, tmp_path: Path) -> None:
        failing = shutil.which("false")
        if failing is None:
            pytest.skip("no 'false' command")
        with pytest.raises(RuntimeError, match="building the cuDLA stand-in failed"):
            build_standin(tmp_path, nvcc=failing, arch="sm_90")
        assert not (tmp_path / "libcudla.so.1").exists()

    def test_arch_flags(self) -> None:
        assert _standin._arch_flags("sm_90") == [
            "-gencode",
            "arch=compute_90,code=[sm_90,compute_90]",
        ]
        assert _standin._arch_flags("87") == ["-gencode", "arch=compute_87,code=[sm_87,compute_87]"]
        assert _standin._arch_flags("native") == ["-arch=native"]
        with pytest.raises(ConfigurationError):
            _standin._arch_flags("hopper")

    def test_command_line(self, tmp_path: Path) -> None:
        command = _standin.build_command(tmp_path / "libcudla.so.1", arch="sm_90")
        assert "-shared" in command
        assert "-soname=libcudla.so.1" in command
        assert command[command.index("-cudart") + 1] == "static"
        assert str(_standin.standin_source_dir() / "standin.cu") in command

    def test_sources_are_package_data(self) -> None:
        directory = _standin.standin_source_dir()
        for name in ("standin.cu", "cudla_abi.h", "loadable.h", "task_math.h"):
            assert (directory / name).is_file(), name

    def test_cli(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        from aiodla.emulator import standin_build

        assert standin_build.main([str(tmp_path), "--nvcc", "no-such-nvcc-here"]) == 1
        assert "not found" in capsys.readouterr().err

    @needs_nvcc
    def test_cli_builds(self, tmp_path: Path) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "aiodla.emulator.standin_build", str(tmp_path), "--nvcc", NVCC],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == str(tmp_path / "libcudla.so.1")

    def test_not_loaded_here(self) -> None:
        assert _standin.standin_loaded() is False


# -- the parser ---------------------------------------------------------------------------


def _python_accepts(data: bytes) -> bool:
    try:
        parse_loadable(data)
    except ModelError:  # LoadableFormatError, or a descriptor TensorSpec refuses
        return False
    return True


def _mutations(vector: Vector, rng: SplitMix64) -> list[bytes]:
    base = vector.loadable
    count = len(vector.model.inputs) + len(vector.model.outputs)
    out: list[bytes] = [base, b"", base[:63], base[:-1], base + b"\0"]

    def edit(offset: int, fmt: str, value: Any) -> bytes:
        data = bytearray(base)
        struct.pack_into(fmt, data, offset, value)
        return bytes(data)

    # header fields
    out += [
        edit(0, "<8s", b"AIODLAEX"),
        edit(8, "<I", 2),
        edit(12, "<I", 72),
        edit(16, "<I", 0),
        edit(16, "<I", 65),
        edit(20, "<I", 0),
        edit(24, "<I", 3),
        edit(28, "<I", 3),
        edit(32, "<d", -1.0),
        edit(32, "<d", float("nan")),
        edit(32, "<d", 3601.0),
        edit(40, "<Q", len(base) + 1),
        edit(48, "<Q", 1),
        edit(56, "<Q", 1),
        edit(64, "<d", float("inf")),
        edit(72, "<d", float("nan")),
    ]
    # every field of every record
    for index in range(count):
        at = 80 + 168 * index
        out += [
            edit(at, "<B", 0),
            edit(at, "<81s", b"A" * 81),
            edit(at, "<2s", b"\x7f\0"),
            edit(at, "<2s", b" \0"),
            edit(at + 88, "<Q", 0),
            edit(at + 88, "<Q", 1 << 40),
            edit(at + 96, "<Q", 0),
            edit(at + 104, "<Q", 70000),
            edit(at + 112, "<Q", 0),
            edit(at + 128, "<B", 0),
            edit(at + 128, "<B", 4),
            edit(at + 128, "<B", 1),
            edit(at + 128, "<B", 2),
            edit(at + 128, "<B", 3),
            edit(at + 129, "<B", 0),
            edit(at + 129, "<B", 7),
            edit(at + 129, "<B", 2),
            edit(at + 129, "<B", 4),
            edit(at + 130, "<B", 0),
            edit(at + 132, "<B", 1),
            edit(at + 136, "<I", 3),
            edit(at + 136, "<I", 0),
            edit(at + 140, "<I", 1),
            edit(at + 144, "<I", 0),
            edit(at + 148, "<I", 0),
            edit(at + 152, "<I", 5),
        ]
        if index:  # a duplicate name
            data = bytearray(base)
            data[at : at + 81] = base[80 : 80 + 81]
            out.append(bytes(data))
    # random byte damage anywhere
    for _ in range(400):
        data = bytearray(base)
        for _ in range(1 + rng.below(3)):
            data[rng.below(len(data))] = rng.below(256)
        out.append(bytes(data))
    return out


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_parser_agrees_with_python(vector: Vector, controls: StandinControls) -> None:
    rng = SplitMix64(len(vector.loadable))
    accepted = rejected = 0
    for data in _mutations(vector, rng):
        status, reason = controls.check_loadable(data)
        python = _python_accepts(data)
        assert (status == 0) == python, (status, reason, data[:96])
        if status:
            assert status == INVALID_MODULE
            assert reason
            rejected += 1
        else:
            accepted += 1
    assert accepted
    assert rejected


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_task_bytes_equal_the_emulated_runtime(vector: Vector, controls: StandinControls) -> None:
    for buffers in vector.buffers:
        inputs = [np.frombuffer(b, dtype=np.uint8).copy() for b in buffers]
        expected = [np.full(s.size, 0xAB, dtype=np.uint8) for s in vector.model.outputs]
        got = [np.full(s.size, 0xCD, dtype=np.uint8) for s in vector.model.outputs]
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN->0 are defined results
            run_model(vector.model, inputs, expected)
        assert controls.run_on_host(vector.loadable, inputs, got) == 0
        for spec, want, have in zip(vector.model.outputs, expected, got, strict=True):
            np.testing.assert_array_equal(have, want, err_msg=f"{vector.name}: {spec.name}")


def test_half_rounding_matches_numpy(controls: StandinControls) -> None:
    """Every float16 output path, on binary64 values chosen to straddle each boundary."""
    from aiodla._tensors import TensorSpec
    from aiodla.emulator._format import make_loadable

    rng = SplitMix64(2024)
    values = [
        0.0,
        -0.0,
        65504.0,
        65519.99,
        65520.0,
        -65520.0,
        2.0**-24,
        2.0**-25,
        2.0**-25 * 1.0000001,
        3 * 2.0**-26,
        5.960464477539063e-08,
        1e-300,
        -1e-300,
    ]
    while len(values) < 4096:
        bits = rng.next()
        exponent = 1023 - 30 + rng.below(50)
        values.append(
            struct.unpack("<d", struct.pack("<Q", (bits & ~(0x7FF << 52)) | (exponent << 52)))[0]
        )
    x = TensorSpec("x", (1, 1, 64, 64), "float32", "nchw")
    y = TensorSpec("y", (1, 1, 64, 64), "float16", "nchw")
    loadable = make_loadable([x], [y], "affine", 0.0, scale=1.0, bias=0.0)
    # float32 inputs are exact in binary64; scale 1 and bias 0 leave them unchanged,
    # so this compares binary64 -> binary16 for values representable as float32.
    with np.errstate(over="ignore"):
        stored = np.array(values, dtype=np.float64).astype(np.float32).reshape(1, 1, 64, 64)
        expected = stored.astype(np.float64).astype(np.float16)
    got = np.zeros(y.size, dtype=np.uint8)
    assert controls.run_on_host(loadable, [x.pack(stored)], [got]) == 0
    np.testing.assert_array_equal(got.view(np.float16).reshape(1, 1, 64, 64), expected)


def test_float16_hwc4_is_accepted_by_both_parsers(controls: StandinControls) -> None:
    """TensorRT's kDLA_HWC4 takes FP16 as well as INT8: both readers agree."""
    from aiodla import TensorSpec
    from aiodla.emulator import make_loadable

    image = TensorSpec("image", (1, 3, 4, 4), "float16", "hwc4")
    out = TensorSpec("out", (1, 3, 4, 4), "float16", "nchw")
    data = make_loadable([image], [out], "affine", 0.0)
    assert _python_accepts(data)
    assert controls.check_loadable(data)[0] == 0
