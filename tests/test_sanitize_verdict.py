"""tests/gpu/sanitize/verdict.py judges compute-sanitizer logs: it excuses exactly the
test frameworks' pooled memory at exit and the deliberate errors, and fails on any
report of aiodla's own, so the GPU machine's sanitizer step means what it says."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

VERDICT = Path(__file__).resolve().parent / "gpu" / "sanitize" / "verdict.py"


@pytest.fixture(scope="module")
def verdict() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sanitizer_verdict", VERDICT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def leak(size: int, *frames: str) -> str:
    lines = [
        f"========= Leaked {size} bytes at 0x7f0000{size:04x}",
        "=========     Saved host backtrace up to driver entry point at allocation time",
        "=========         Host Frame: cuMemAlloc_v2 [0x2c0a1] in libcuda.so.1",
        "=========         Host Frame: cudaMalloc [0x51f3e] in libcudart.so.13",
    ]
    lines += [f"=========         Host Frame: {frame}" for frame in frames]
    lines.append("=========         Host Frame: _PyEval_EvalFrameDefault [0x1a2b3] in python3")
    return "\n".join(lines) + "\n=========\n"


CUPY = "cupy.cuda.memory._malloc [0x7e1] in cupy/cuda/memory.cpython-312-x86_64-linux-gnu.so"
CUPY_BACKENDS = "malloc [0x31] in cupy_backends/cuda/api/runtime.cpython-312-x86_64-linux-gnu.so"
TORCH = "c10::cuda::CUDACachingAllocator::malloc [0x3f21] in libc10_cuda.so"
BINDINGS = "cudaMalloc [0x9a1] in cuda/bindings/cyruntime.cpython-312-x86_64-linux-gnu.so"
STANDIN = "aiodla_standin::Platform::device_alloc [0x1f0] in libcudla.so.1"


NVCUVID = " [0x2c74f] in libnvcuvid.so.1"
SEQUENCE = "NvDecoder::HandleVideoSequence(CUVIDEOFORMAT*) [0xfd23b] in PyNvVideoCodec_130.cpython-312-x86_64-linux-gnu.so"
DISPLAY = "NvDecoder::HandlePictureDisplay(_CUVIDPARSERDISPINFO*) [0xf98a6] in PyNvVideoCodec_130.cpython-312-x86_64-linux-gnu.so"
DECODE = "NvDecoder::Decode(unsigned char const*, int, int, long, bool) [0xf2521] in PyNvVideoCodec_130.cpython-312-x86_64-linux-gnu.so"


def decoder_leak(what: str, *frames: str) -> str:
    """A leak report as memcheck prints one of the video decoder's allocations: the
    frames as given, innermost first, then the Python frame that called Decode."""
    lines = [
        f"========= Leaked 245,760 bytes {what}",
        "=========     Saved host backtrace up to driver entry point at allocation time",
    ]
    lines += [
        f"=========         Host Frame:{frame}"
        if frame.startswith(" ")
        else f"=========         Host Frame: {frame}"
        for frame in frames
    ]
    lines.append("=========         Host Frame: pictures in _video_nvdec.py:222")
    return "\n".join(lines) + "\n=========\n"


def write_log(folder: Path, *reports: str, errors: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    body = "========= COMPUTE-SANITIZER\n" + "".join(reports)
    body += "========= LEAK SUMMARY: 1 bytes leaked in 1 allocations\n"
    body += f"========= ERROR SUMMARY: {errors} errors\n"
    (folder / "123.log").write_text(body)
    return folder


def unexcused(verdict: ModuleType, folder: Path) -> list[str]:
    _, bad = verdict.judge(folder, trap=False)
    return list(bad)


class TestLeaks:
    def test_the_frameworks_pools_are_excused(self, verdict: ModuleType, tmp_path: Path) -> None:
        reports = [leak(1024, CUPY), leak(2048, CUPY_BACKENDS), leak(4096, TORCH)]
        folder = write_log(tmp_path / "gpu-memcheck", *reports, errors=3)
        assert unexcused(verdict, folder) == []

    @pytest.mark.parametrize("frame", [BINDINGS, STANDIN], ids=["cuda-bindings", "stand-in"])
    def test_aiodla_leaks_fail(self, verdict: ModuleType, tmp_path: Path, frame: str) -> None:
        folder = write_log(tmp_path / "gpu-memcheck", leak(512, frame), errors=1)
        bad = unexcused(verdict, folder)
        assert len(bad) == 1 and "Leaked 512 bytes" in bad[0]

    def test_aiodla_path_under_a_framework_frame_still_fails(
        self, verdict: ModuleType, tmp_path: Path
    ) -> None:
        # A dependency's frame higher on the stack does not make aiodla's allocation theirs.
        folder = write_log(tmp_path / "gpu-memcheck", leak(256, STANDIN, CUPY), errors=1)
        assert len(unexcused(verdict, folder)) == 1

    @pytest.mark.parametrize(
        "report",
        [
            decoder_leak("from CUDA array 0x7f23440c8eb0", NVCUVID, SEQUENCE, NVCUVID),
            decoder_leak("at 0x206028000", NVCUVID, SEQUENCE, NVCUVID),
            decoder_leak("at 0x30a8c00", DISPLAY, NVCUVID, DECODE),
        ],
        ids=["surface", "working-memory", "output-picture"],
    )
    def test_the_nvdec_decoders_own_memory_is_excused(
        self, verdict: ModuleType, tmp_path: Path, report: str
    ) -> None:
        folder = write_log(tmp_path / "gpu-memcheck", report, errors=1)
        assert unexcused(verdict, folder) == []

    @pytest.mark.parametrize(
        "report",
        [
            # aiodla's copy of a picture, allocated while the decoder is on the stack
            decoder_leak("at 0x2a9a003c00", BINDINGS, DECODE),
            # the decoder library's frame, but aiodla's allocator further down
            decoder_leak("from CUDA array 0x7f1", NVCUVID, SEQUENCE, BINDINGS),
            # libnvcuvid driven by something other than PyNvVideoCodec
            decoder_leak("from CUDA array 0x7f2", NVCUVID, NVCUVID),
            # a CUDA array whose first frame is not the decoder's
            decoder_leak("from CUDA array 0x7f3", STANDIN, SEQUENCE),
        ],
        ids=["aiodla-copy", "aiodla-below", "no-pynvvideocodec", "other-first-frame"],
    )
    def test_other_leaks_beside_the_decoder_still_fail(
        self, verdict: ModuleType, tmp_path: Path, report: str
    ) -> None:
        folder = write_log(tmp_path / "gpu-memcheck", report, errors=1)
        assert len(unexcused(verdict, folder)) == 1

    def test_a_leak_with_no_backtrace_fails(self, verdict: ModuleType, tmp_path: Path) -> None:
        report = "========= Leaked 64 bytes at 0x7f0000abcd\n=========\n"
        folder = write_log(tmp_path / "gpu-memcheck", report, errors=1)
        assert len(unexcused(verdict, folder)) == 1

    def test_other_errors_are_never_excused_as_leaks(
        self, verdict: ModuleType, tmp_path: Path
    ) -> None:
        report = (
            "========= Invalid __global__ write of size 4 bytes\n"
            f"=========     Host Frame: {CUPY}\n=========\n"
        )
        folder = write_log(tmp_path / "gpu-memcheck", report, errors=1)
        assert len(unexcused(verdict, folder)) == 1


def test_main_exit_status(verdict: ModuleType, tmp_path: Path) -> None:
    clean = write_log(tmp_path / "clean", leak(1024, TORCH), errors=1)
    dirty = write_log(tmp_path / "dirty", leak(1024, BINDINGS), errors=1)
    assert verdict.main([str(clean)]) == 0
    assert verdict.main([str(clean), str(dirty)]) == 1


def test_sizes_printed_with_thousands_separators_are_leaks(
    verdict: ModuleType, tmp_path: Path
) -> None:
    # compute-sanitizer 2025.3 prints "Leaked 13,107,200 bytes".
    report = leak(1, CUPY).replace("Leaked 1 bytes", "Leaked 13,107,200 bytes")
    assert unexcused(verdict, write_log(tmp_path / "pool", report, errors=1)) == []
    report = leak(1, BINDINGS).replace("Leaked 1 bytes", "Leaked 13,107,200 bytes")
    assert len(unexcused(verdict, write_log(tmp_path / "ours", report, errors=1))) == 1


def probe(call: str, error: str, first_frame: str) -> str:
    return (
        f'========= Program hit {error} due to "invalid argument" on CUDA API call to {call}.\n'
        "=========     Saved host backtrace up to driver entry point at error\n"
        f"=========         Host Frame:  [0xd4a2] in {first_frame}\n"
        "=========         Host Frame:  [0x355e8] in _device.cpython-312-x86_64-linux-gnu.so\n"
        "=========\n"
    )


class TestBindingsProbe:
    CYDRIVER = "cydriver.cpython-312-x86_64-linux-gnu.so"

    def test_the_bindings_entry_point_lookup_is_excused(
        self, verdict: ModuleType, tmp_path: Path
    ) -> None:
        reports = [
            probe("cuGetProcAddress_v2", "CUDA_ERROR_INVALID_VALUE (error 1)", self.CYDRIVER),
            probe("cuGetProcAddress", "CUDA_ERROR_NOT_FOUND (error 500)", self.CYDRIVER),
        ]
        assert unexcused(verdict, write_log(tmp_path / "k", *reports, errors=2)) == []

    @pytest.mark.parametrize(
        ("call", "error", "frame"),
        [
            ("cuGetProcAddress_v2", "CUDA_ERROR_INVALID_VALUE (error 1)", "libcudla.so.1"),
            ("cuMemAlloc_v2", "CUDA_ERROR_INVALID_VALUE (error 1)", CYDRIVER),
            ("cuGetProcAddress_v2", "CUDA_ERROR_OUT_OF_MEMORY (error 2)", CYDRIVER),
        ],
        ids=["lookup-from-the-stand-in", "another-call", "another-error"],
    )
    def test_anything_else_counts(
        self, verdict: ModuleType, tmp_path: Path, call: str, error: str, frame: str
    ) -> None:
        folder = write_log(tmp_path / "k", probe(call, error, frame), errors=1)
        assert len(unexcused(verdict, folder)) == 1
