"""Element conversions in several threads at once (the engine packs and unpacks on the
loop's thread and in worker threads): each thread converts with its own scratch, and
gets numpy's results."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from aiodla._tensors import TensorSpec

from tensor_reference import same_bits

# 128 x 128 elements a channel: blocks the vectorized kernels take (not numpy's casts).
HALF = TensorSpec("x", (1, 3, 128, 128), "float16", "chw16")


def round_trip(seed: int, start: threading.Barrier) -> tuple[Any, Any, Any, Any]:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(HALF.shape) * 1000).astype(np.float32)
    integers = rng.integers(-70000, 70000, HALF.shape)
    start.wait()  # every thread converts its first block at the same time
    packed = HALF.pack(values)
    back = HALF.unpack(packed, dtype=np.float32)
    from_integers = HALF.unpack(HALF.pack(integers, validate=False))
    return values, back, integers, from_integers


def test_fresh_threads_convert_at_once() -> None:
    threads = 4
    start = threading.Barrier(threads)
    with ThreadPoolExecutor(threads) as pool:
        outcomes = list(pool.map(round_trip, range(threads), [start] * threads))
    for values, back, integers, from_integers in outcomes:
        with np.errstate(over="ignore"):
            assert same_bits(back, values.astype(np.float16).astype(np.float32))
            assert same_bits(from_integers, integers.astype(np.float16))
