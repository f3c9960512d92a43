"""Packing and unpacking DLA tensor layouts against a plain copy of the same bytes.

For each case the baseline is ``np.copyto`` of one uint8 array into another, each as
large as the tensor's DLA buffer (``spec.size`` bytes: every lane, padding included).
Measured per case, interleaved round by round so a noisy machine slows all of them
alike and each starts from the caches the others left (median, quartiles and min over
the rounds, and each one's ratio to the copy of the same rounds: ``x copy``). The copy
is also timed back to back, its buffers warm in cache, a harder baseline (``x warm``):
the 3x target is read against the interleaved copy, and both ratios are reported.

- ``pack (BoundTensor.write)``: the engine's path, views computed once at bind time;
- ``pack (TensorSpec.pack, out=)`` and ``pack (TensorSpec.pack)``: plain calls, the
  first into an existing buffer, the second into a fresh one;
- ``unpack (BoundTensor.read)`` and ``unpack (TensorSpec.unpack)``: a fresh logical
  array in the tensor's result type (float16 for float16 tensors, float32 for int8
  with a scale), and ``unpack to float32`` where the tensor is float16;
- for context, numpy's own ``astype`` of the logical array, no layout at all.

Cases: 1x3x640x640 and 1x256x80x80, float32 NCHW user arrays into float16 CHW16, and
1x256x80x80 into int8 CHW32 with a scale (0.0123, computed in binary64; and 1/64, a
power of two, computed in float32 exactly).

Usage::

    python benchmarks/bench_layouts.py [--rounds 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _reports import report_path

from aiodla import TensorSpec

TARGET_RATIO = 3.0
TARGET_CASE = "1x3x640x640 float32 -> float16 chw16"


def _cases() -> list[tuple[str, TensorSpec, np.dtype[Any]]]:
    return [
        (TARGET_CASE, TensorSpec("x", (1, 3, 640, 640), "float16", "chw16"), np.dtype(np.float32)),
        (
            "1x256x80x80 float32 -> float16 chw16",
            TensorSpec("x", (1, 256, 80, 80), "float16", "chw16"),
            np.dtype(np.float32),
        ),
        (
            "1x256x80x80 float32 -> int8 chw32, scale 0.0123",
            TensorSpec("x", (1, 256, 80, 80), "int8", "chw32", scale=0.0123),
            np.dtype(np.float32),
        ),
        (
            "1x256x80x80 float32 -> int8 chw32, scale 1/64",
            TensorSpec("x", (1, 256, 80, 80), "int8", "chw32", scale=1 / 64),
            np.dtype(np.float32),
        ),
    ]


def _operations(spec: TensorSpec, source: np.dtype[Any]) -> dict[str, Callable[[], object]]:
    rng = np.random.default_rng(0)
    array = (rng.standard_normal(spec.shape) * 2.0).astype(source)
    buffer = np.zeros(spec.size, np.uint8)
    copy_from = np.ones(spec.size, np.uint8)
    copy_to = np.zeros(spec.size, np.uint8)
    bound = spec.bind(buffer)
    bound.write(array)
    fresh = np.zeros(spec.size, np.uint8)
    spec.pack(array, out=fresh)
    assert fresh.tobytes() == buffer.tobytes()
    operations: dict[str, Callable[[], object]] = {
        f"np.copyto of {spec.size} bytes (the DLA buffer)": lambda: np.copyto(copy_to, copy_from),
        "pack (BoundTensor.write)": lambda: bound.write(array),
        "pack (TensorSpec.pack, out=)": lambda: spec.pack(array, out=fresh, validate=False),
        "pack (TensorSpec.pack)": lambda: spec.pack(array, validate=False),
        "unpack (BoundTensor.read)": bound.read,
        "unpack (TensorSpec.unpack)": lambda: spec.unpack(buffer),
    }
    if spec.dtype == "float16":
        operations["unpack to float32 (BoundTensor.read)"] = lambda: bound.read(dtype=np.float32)
        operations["context: numpy astype float32 -> float16, no layout"] = lambda: array.astype(
            np.float16
        )
        stored = array.astype(np.float16)
        operations["context: numpy astype float16 -> float32, no layout"] = lambda: stored.astype(
            np.float32
        )
    else:
        operations["context: TensorSpec.quantize, no layout"] = lambda: spec.quantize(array)
    return operations


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q1, median, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {"median": median, "q1": q1, "q3": q3, "min": ordered[0], "max": ordered[-1]}


def run_case(spec: TensorSpec, source: np.dtype[Any], rounds: int) -> dict[str, Any]:
    operations = _operations(spec, source)
    names = list(operations)
    copy_name = names[0]
    for operation in operations.values():  # warm up: scratch arrays, caches, pages
        for _ in range(3):
            operation()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter_ns()
            operations[name]()
            times[name].append((time.perf_counter_ns() - start) / 1e6)
    copy = times[copy_name]
    warm: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        operations[copy_name]()
        warm.append((time.perf_counter_ns() - start) / 1e6)
    warm_median = statistics.median(warm)
    result: dict[str, Any] = {}
    for name in names:
        stats = _quantiles(times[name])
        paired = _quantiles([t / c for t, c in zip(times[name], copy, strict=True)])
        stats["ratio_to_copy"] = stats["median"] / statistics.median(copy)
        stats["paired_ratio"] = paired
        stats["ratio_to_warm_copy"] = stats["median"] / warm_median
        result[name] = stats
    return {
        "warm_copy_ms": _quantiles(warm),
        "bytes": spec.size,
        "elements": int(np.prod(spec.shape)),
        "spec": spec.describe(),
        "scale": spec.scale,
        "source": str(source),
        "baseline": copy_name,
        "ms": result,
    }


def _print_case(title: str, case: dict[str, Any]) -> None:
    print(f"\n{title}  ({case['elements']:,} elements, DLA buffer {case['bytes']:,} bytes)")
    print(
        f"  {'operation':<56} {'median ms':>9}  {'q1..q3 ms':>15}  {'x copy':>6}  {'x copy q1..q3':>13}  {'x warm':>6}"
    )
    for name, stats in case["ms"].items():
        paired = stats["paired_ratio"]
        print(
            f"  {name:<56} {stats['median']:9.3f}  {stats['q1']:7.3f}..{stats['q3']:<7.3f}"
            f"  {stats['ratio_to_copy']:6.2f}  {paired['q1']:6.2f}..{paired['q3']:<6.2f}"
            f"  {stats['ratio_to_warm_copy']:6.2f}"
        )
    warm = case["warm_copy_ms"]
    print(
        f"  {'np.copyto back to back, cache warm':<56} {warm['median']:9.3f}  {warm['q1']:7.3f}..{warm['q3']:<7.3f}"
    )


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    try:
        from numpy._core import _multiarray_umath as umath

        info["numpy_simd_baseline"] = list(umath.__cpu_baseline__)
        info["numpy_simd_dispatch"] = list(umath.__cpu_dispatch__)
    except (ImportError, AttributeError):  # pragma: no cover - other numpy layouts
        pass
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover - not Linux
        pass
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--json", help="report path (default: a temporary file)")
    args = parser.parse_args()
    cases: dict[str, Any] = {}
    for title, spec, source in _cases():
        cases[title] = run_case(spec, source, args.rounds)
        _print_case(title, cases[title])
    target = cases[TARGET_CASE]["ms"]
    verdict = {
        name: {
            "ratio_to_copy": target[name]["ratio_to_copy"],
            "ratio_to_warm_copy": target[name]["ratio_to_warm_copy"],
            "within": target[name]["ratio_to_copy"] <= TARGET_RATIO,
        }
        for name in (
            "pack (BoundTensor.write)",
            "unpack (BoundTensor.read)",
            "unpack to float32 (BoundTensor.read)",
        )
    }
    print(f"\nTarget: {TARGET_CASE}, pack and unpack within {TARGET_RATIO}x the copy:")
    for name, check in verdict.items():
        print(
            f"  {name:<40} {check['ratio_to_copy']:5.2f}x the copy  {'met' if check['within'] else 'NOT met'}"
            f"  ({check['ratio_to_warm_copy']:.2f}x the warm copy)"
        )
    document = {
        "command": "python " + " ".join(sys.argv),
        "rounds": args.rounds,
        "machine": _machine(),
        "target": {"case": TARGET_CASE, "ratio": TARGET_RATIO, "verdict": verdict},
        "cases": cases,
    }
    path = report_path(args.json, "layouts.json")
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
