"""ImagePreprocess.apply on the CPU: milliseconds per camera frame into a 640x640 model
input, by source format and resize mode (median and min..max of interleaved repeats).

This is the host's cost of pre-processing, the path taken with host conversion (and the
fallback where the fused GPU kernel cannot be prepared); the fused kernel's cost on a
GPU is measured by ``benchmarks/bench_preprocess_kernels.py``.

Usage::

    python benchmarks/bench_preprocess.py [--repeats 7] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from aiodla import ImagePreprocess, TensorSpec

MODEL = TensorSpec("images", (1, 3, 640, 640), "float16", "chw16")


def frame(source: str, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if source in ("nv12", "i420"):
        return rng.integers(0, 256, (height * 3 // 2, width)).astype(np.uint8)
    return rng.integers(0, 256, (height, width, len(source))).astype(np.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=10, help="frames per timing")
    args = parser.parse_args()
    cases = [
        (source, resize, size)
        for source in ("bgr", "nv12", "i420")
        for resize in ("letterbox", "stretch")
        for size in ((1080, 1920), (1000, 1500))
    ]
    out = np.empty(MODEL.shape, np.float32)
    timings: dict[tuple[str, str, tuple[int, int]], list[float]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case in cases:  # interleaved: drift hits every case alike
            source, resize, size = case
            pre = ImagePreprocess(source=source, order="rgb", resize=resize)
            image = frame(source, *size)
            pre.apply(image, MODEL, out)  # tables planned once per frame size
            started = time.perf_counter()
            for _ in range(args.rounds):
                pre.apply(image, MODEL, out)
            timings[case].append((time.perf_counter() - started) / args.rounds * 1e3)
    print(f"{'frame':>10} {'source':>6} {'resize':>9}  ms per frame (median, min..max)")
    for (source, resize, (height, width)), values in timings.items():
        print(
            f"{width:>5}x{height:<4} {source:>6} {resize:>9}  {statistics.median(values):6.2f} "
            f"({min(values):.2f}..{max(values):.2f})"
        )


if __name__ == "__main__":
    main()
