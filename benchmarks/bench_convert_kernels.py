"""The NVRTC conversion kernels against a device-to-device copy of the same bytes.

Per case: the kernel's GPU time and that of ``cudaMemcpyAsync`` (device to device) of
the DLA buffer's bytes (``spec.size``), each the median of ``--rounds`` single runs
timed with CUDA events, interleaved round by round; and their ratio (target: <= 2).
Then the Python cost of one launch (``ConversionKernels.pack`` / ``unpack``: lookup,
parameter block, ``cuLaunchKernel``), timed on the host over many launches of a tiny
tensor, and, for comparison, cuda.core's ``launch`` of the same kernel.

Usage (on a GPU machine, with cupy)::

    python benchmarks/bench_convert_kernels.py [--rounds 50]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np

from aiodla._tensors import TensorSpec
from aiodla.runtime._conversion_kernels import ConversionKernels


def timed(stream: Any, run: Any) -> float:
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    run()
    stop.record(stream)
    stop.synchronize()
    return float(cp.cuda.get_elapsed_time(start, stop)) * 1000.0  # microseconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()

    image = TensorSpec("images", (1, 3, 640, 640), "float16", "chw16")
    head = TensorSpec("head", (1, 255, 80, 80), "float16", "chw16")
    quant = TensorSpec("q", (1, 256, 80, 80), "int8", "chw32", scale=0.0123)
    tiny = TensorSpec("tiny", (1, 3, 8, 8), "float16", "chw16")
    f32, u8, f16 = np.dtype("float32"), np.dtype("uint8"), np.dtype("float16")
    packs = [(image, f32), (image, u8), (quant, f32), (tiny, f32)]
    unpacks = [(head, f16), (head, f32), (quant, f32), (tiny, f16)]
    with tempfile.TemporaryDirectory() as cache:
        began = time.perf_counter()
        kernels = ConversionKernels.compile(packs, unpacks, cache_dir=Path(cache))
        compiled = time.perf_counter() - began
        began = time.perf_counter()
        ConversionKernels.compile(packs, unpacks, cache_dir=Path(cache))
        cached = time.perf_counter() - began
    print(f"compile: {compiled * 1e3:.0f} ms with NVRTC, {cached * 1e3:.1f} ms from the cache")

    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    cases: list[tuple[str, int, Any]] = []

    def add_pack(spec: TensorSpec, source: np.dtype[Any]) -> None:
        array = cp.asarray(
            rng.standard_normal(spec.shape).astype(source)
            if source.kind == "f"
            else rng.integers(0, 255, spec.shape).astype(source)
        )
        out = cp.empty(spec.size, cp.uint8)
        steps = tuple(s // source.itemsize for s in array.strides)
        cases.append(
            (
                f"pack {'x'.join(map(str, spec.shape))} {source} -> {spec.dtype} {spec.format}",
                spec.size,
                lambda: kernels.pack(spec, source, array.data.ptr, steps, out.data.ptr, stream.ptr),
            )
        )

    def add_unpack(spec: TensorSpec, result: np.dtype[Any]) -> None:
        raw = cp.asarray(np.frombuffer(rng.bytes(spec.size), np.uint8))
        out = cp.empty(spec.shape, result)
        cases.append(
            (
                f"unpack {'x'.join(map(str, spec.shape))} {spec.dtype} {spec.format} -> {result}",
                spec.size,
                lambda: kernels.unpack(spec, result, raw.data.ptr, out.data.ptr, stream.ptr),
            )
        )

    for spec, source in packs[:3]:
        add_pack(spec, source)
    for spec, result in unpacks[:3]:
        add_unpack(spec, result)

    copies: dict[int, Any] = {}
    for _, nbytes, _ in cases:
        if nbytes not in copies:
            a, b = cp.empty(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
            copies[nbytes] = (a, b)

    def copy(nbytes: int) -> Any:
        a, b = copies[nbytes]
        return lambda: cp.cuda.runtime.memcpyAsync(
            b.data.ptr, a.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr
        )

    for _, nbytes, run in cases:  # warm up: module load, clocks
        for _ in range(5):
            timed(stream, run)
            timed(stream, copy(nbytes))
    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _, _ in cases}
    for _ in range(args.rounds):
        for name, nbytes, run in cases:
            results[name][0].append(timed(stream, run))
            results[name][1].append(timed(stream, copy(nbytes)))
    print(f"{'case':58} {'kernel us':>10} {'D2D us':>8} {'ratio':>6}")
    for name, nbytes, _ in cases:
        kernel_us = statistics.median(results[name][0])
        copy_us = statistics.median(results[name][1])
        print(
            f"{name:58} {kernel_us:10.2f} {copy_us:8.2f} {kernel_us / copy_us:6.2f}  ({nbytes} B)"
        )

    # Python cost of a launch: a tiny tensor, so the GPU keeps up and the queue never fills.
    array = cp.zeros(tiny.shape, cp.float32)
    out = cp.empty(tiny.size, cp.uint8)
    raw = cp.zeros(tiny.size, cp.uint8)
    back = cp.empty(tiny.shape, cp.float16)
    steps = tuple(s // 4 for s in array.strides)
    for label, launch in (
        ("pack", lambda: kernels.pack(tiny, f32, array.data.ptr, steps, out.data.ptr, stream.ptr)),
        ("unpack", lambda: kernels.unpack(tiny, f16, raw.data.ptr, back.data.ptr, stream.ptr)),
    ):
        samples = []
        for _ in range(20):
            began = time.perf_counter()
            for _ in range(100):
                launch()
            samples.append((time.perf_counter() - began) / 100 * 1e6)
            stream.synchronize()
        print(
            f"launch cost ({label}): median {statistics.median(samples):.2f} us, "
            f"min {min(samples):.2f} us per call (Python, host side)"
        )
    try:  # for comparison: cuda.core's own launch of the same kernel
        import cuda.core as core

        if not hasattr(core, "launch"):
            import cuda.core.experimental as core  # type: ignore[no-redef]
        stream_object = core.Stream.from_handle(stream.ptr)
        function = kernels._unpacks[(tiny, f16)].launch
        kernel = (
            core.Kernel.from_handle(int(function.function))
            if hasattr(core.Kernel, "from_handle")
            else None
        )
        if kernel is not None:
            config = core.LaunchConfig(grid=function.grid, block=256)
            samples = []
            for _ in range(20):
                began = time.perf_counter()
                for _ in range(100):
                    core.launch(stream_object, config, kernel, raw.data.ptr, back.data.ptr)
                samples.append((time.perf_counter() - began) / 100 * 1e6)
                stream.synchronize()
            print(
                f"launch cost (cuda.core.launch, for comparison): median "
                f"{statistics.median(samples):.2f} us"
            )
    except Exception as exc:  # only a comparison
        print(f"cuda.core.launch comparison skipped: {exc!r}")


if __name__ == "__main__":
    main()
