"""The conversion kernels' source compiles with NVRTC for the GPUs aiodla targets.

No GPU is needed to compile: this runs in CI (cuda-core and nvidia-cuda-nvrtc are test
dependencies), so a source that NVRTC refuses never reaches a Jetson. sm_87 is Jetson
AGX Orin's GPU, sm_90 the H200 the GPU tests run on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiodla import TensorSpec
from aiodla._source_dtypes import accepted_dtypes
from aiodla.runtime._conversion_kernels import _OPTIONS, kernel_source

# Compiling (g++ for the host build, NVRTC) is CPU-bound: beside another suite on a
# 2-CPU machine one build passed the 60 s default meant to catch hangs.
pytestmark = pytest.mark.timeout(600)

SPECS = [
    TensorSpec("images", (1, 3, 640, 640), "float16", "chw16"),
    TensorSpec("q", (1, 5, 7, 9), "int8", "chw32", scale=0.05),
    TensorSpec("img", (1, 3, 32, 40), "uint8", "hwc4"),
    TensorSpec("n", (2, 3, 5, 7), "float32", "nhwc"),
]


def nvrtc_program(source: str, arch: str) -> Any:
    core = pytest.importorskip("cuda.core")
    program_type = getattr(core, "Program", None)
    if program_type is None:  # cuda-core before 1.0 kept it in .experimental
        core = pytest.importorskip("cuda.core.experimental")
        program_type = core.Program
    try:
        from cuda.bindings import nvrtc

        error, *_ = nvrtc.nvrtcVersion()
    except Exception as exc:
        pytest.skip(f"NVRTC is not installed here: {exc}")
    assert int(error) == 0
    options = core.ProgramOptions(arch=arch, name="aiodla_conversion", **_OPTIONS)
    return program_type(source, "c++", options)


@pytest.mark.parametrize("arch", ["sm_87", "sm_90"])
def test_an_engines_kernels_compile(arch: str) -> None:
    packs = [(spec, dtype) for spec in SPECS for dtype in accepted_dtypes(spec)]
    unpacks = [(spec, spec.result_dtype) for spec in SPECS]
    program = nvrtc_program(kernel_source(packs, unpacks), arch)
    try:
        code = program.compile("cubin")
    finally:
        program.close()
    cubin = bytes(code.code)
    assert cubin[:4] == b"\x7fELF"  # a device ELF image
    # Every kernel the engine will look up by name is in the image.
    assert b"aiodla" in cubin or len(cubin) > 10_000


def test_a_float16_to_float32_unpack_compiles() -> None:
    spec = TensorSpec("h", (1, 19, 8, 6), "float16", "chw16")
    source = kernel_source([], [(spec, np.dtype(np.float32))])
    program = nvrtc_program(source, "sm_87")
    try:
        assert bytes(program.compile("cubin").code)[:4] == b"\x7fELF"
    finally:
        program.close()
