"""Element conversions in several threads at once (the engine packs and unpacks on the
loop's thread and in worker threads): each thread converts with its own scratch, and
gets numpy's results. A scratch buffer grown for a larger array replaces the old one,
which is then freed."""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from aiodla import _convert
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


def test_a_grown_scratch_buffer_replaces_the_old_one() -> None:
    scratch = _convert._Scratch()
    f32 = np.dtype(np.float32)
    small = scratch.array("t", f32, (4,))
    replaced = weakref.ref(small.base)
    large = scratch.array("t", f32, (2 * _convert._BLOCK,))
    # The small shape again: a view of the buffer in use, none kept of the old one.
    assert np.shares_memory(scratch.array("t", f32, (4,)), large)
    del small
    assert replaced() is None
