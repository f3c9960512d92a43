"""The emulator's pseudo-random draws (SplitMix64's finalizer over a Weyl sequence), as
the loadable format defines them: the ``mix`` op and the ``detect`` op both draw from
them, byte for byte as the GPU stand-in does."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["_finalize", "_finalize_int", "_stream"]

_MASK = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15
_OUTPUT_STEP = 0xD1B54A32D192ED03


def _finalize(z: np.ndarray[Any, Any], scratch: np.ndarray[Any, Any]) -> None:
    """SplitMix64's finalizer on uint64 ``z``, in place (``scratch`` as large as ``z``)."""
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        np.right_shift(z, np.uint64(shift), out=scratch)
        np.bitwise_xor(z, scratch, out=z)
        np.multiply(z, np.uint64(factor), out=z)  # wraps mod 2**64, as uint64 arrays do
    np.right_shift(z, np.uint64(31), out=scratch)
    np.bitwise_xor(z, scratch, out=z)


def _finalize_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _stream(start: int, count: int) -> np.ndarray[Any, Any]:
    """``(j + 1) * G + start`` for j in 0..count-1, mod 2**64."""
    steps = np.arange(1, count + 1, dtype=np.uint64)
    np.multiply(steps, np.uint64(_G), out=steps)
    np.add(steps, np.uint64(start), out=steps)
    return steps
