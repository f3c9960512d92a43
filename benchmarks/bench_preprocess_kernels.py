"""The fused pre-processing kernel against a device-to-device copy of the frame.

Per case: the kernel's GPU time for one frame (colour conversion, letterbox resize,
normalization, FP16 CHW16 or INT8 CHW32 layout, all of the DLA buffer written) and that
of ``cudaMemcpyAsync`` (device to device) of the frame's bytes, each the median of
``--rounds`` single runs timed with CUDA events, interleaved round by round; and their
ratio. The copy is the floor a frame already on the GPU costs to move once. Each
kernel's output is checked against numpy first, so a fast wrong kernel cannot report.
Then the Python cost of one ``PreprocessKernels.launch`` on the host.

Usage (on a GPU machine, with cupy)::

    python benchmarks/bench_preprocess_kernels.py [--rounds 50]
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
from bench_convert_kernels import timed  # (beside this script: same event timing)

from aiodla import ImagePreprocess
from aiodla._tensors import TensorSpec
from aiodla.runtime._preprocess_kernels import PreprocessKernels

IMAGENET = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()

    detector = TensorSpec("images", (1, 3, 640, 640), "float16", "chw16")
    quantized = TensorSpec("q", (1, 3, 640, 640), "int8", "chw32", scale=1 / 64)
    cases = [
        # the case first: what the ratio is reported for
        ("1920x1080 bgr -> 640x640 fp16 chw16", detector,
         ImagePreprocess(source="bgr", order="rgb", resize="letterbox", **IMAGENET)),
        ("1920x1080 nv12 -> 640x640 fp16 chw16", TensorSpec("n", (1, 3, 640, 640), "float16",
         "chw16"), ImagePreprocess(source="nv12", order="rgb", resize="letterbox", **IMAGENET)),
        ("1920x1080 i420 -> 640x640 fp16 chw16", TensorSpec("i", (1, 3, 640, 640), "float16",
         "chw16"), ImagePreprocess(source="i420", order="rgb", resize="letterbox", **IMAGENET)),
        ("1920x1080 bgr -> 640x640 int8 chw32", quantized,
         ImagePreprocess(source="bgr", order="rgb", resize="stretch", **IMAGENET)),
    ]  # fmt: skip
    targets = [(spec, pre) for _, spec, pre in cases]
    with tempfile.TemporaryDirectory() as cache:
        began = time.perf_counter()
        kernels = PreprocessKernels.compile(targets, cache_dir=Path(cache))
        compiled = time.perf_counter() - began
        began = time.perf_counter()
        PreprocessKernels.compile(targets, cache_dir=Path(cache))
        cached = time.perf_counter() - began
    print(f"compile: {compiled * 1e3:.0f} ms with NVRTC, {cached * 1e3:.1f} ms from the cache")

    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    runs: list[tuple[str, int, Any, Any]] = []
    for name, spec, pre in cases:
        shape = (1620, 1920) if pre.source in ("nv12", "i420") else (1080, 1920, 3)
        frame = rng.integers(0, 256, shape, np.uint8)
        device, copy_target = cp.asarray(frame), cp.empty(frame.size, cp.uint8)
        out = cp.empty(spec.size, cp.uint8)

        def run(spec: TensorSpec = spec, device: Any = device, out: Any = out) -> None:
            pitch = device.strides[0]
            kernels.launch(spec, device.data.ptr, 1080, 1920, pitch, out.data.ptr, stream.ptr)

        def copy(device: Any = device, target: Any = copy_target) -> None:
            cp.cuda.runtime.memcpyAsync(
                target.data.ptr, device.data.ptr, device.nbytes,
                cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr,
            )  # fmt: skip

        run()
        stream.synchronize()
        if cp.asnumpy(out).tobytes() != spec.pack(pre.apply(frame, spec)).tobytes():
            raise SystemExit(f"{name}: the kernel's bytes differ from numpy's")
        runs.append((name, frame.nbytes, run, copy))

    for _, _, run, copy in runs:  # warm up: module load, clocks
        for _ in range(5):
            timed(stream, run)
            timed(stream, copy)
    kernel_us: dict[str, list[float]] = {name: [] for name, _, _, _ in runs}
    copy_us: dict[str, list[float]] = {name: [] for name, _, _, _ in runs}
    for _ in range(args.rounds):
        for name, _, run, copy in runs:
            kernel_us[name].append(timed(stream, run))
            copy_us[name].append(timed(stream, copy))
    print(f"{'case (median of ' + str(args.rounds) + ')':40} {'kernel us':>10} {'D2D us':>8} "
          f"{'ratio':>6}")  # fmt: skip
    for name, nbytes, _, _ in runs:
        kernel, copied = statistics.median(kernel_us[name]), statistics.median(copy_us[name])
        print(f"{name:40} {kernel:10.2f} {copied:8.2f} {kernel / copied:6.2f}  (frame {nbytes} B)")

    # Python cost of a launch, on the host: lookup, cached placement, parameter block.
    name, _, run, _ = runs[0]
    samples = []
    for _ in range(20):
        began = time.perf_counter()
        for _ in range(100):
            run()
        samples.append((time.perf_counter() - began) / 100 * 1e6)
        stream.synchronize()
    print(
        f"launch cost: median {statistics.median(samples):.2f} us, min {min(samples):.2f} us "
        "per call (Python, host side; the GPU may lag behind)"
    )


if __name__ == "__main__":
    main()
