"""What a tensor spec tells the modules below it: its name, logical shape, element
type and layout in bytes. :class:`~aiodla.TensorSpec` satisfies it; the layout
planner (``_layout.Laid``) and the descriptor writer (``_descriptors.Described``) each
ask a little more, and neither imports the spec itself (it is built on both)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

__all__ = ["SpecFacts"]


class SpecFacts(Protocol):
    """A tensor's name, logical (n, c, h, w) shape, dtype name, byte strides (None
    where the layout has none) and size in bytes, and its numpy element type."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, int, int, int]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def strides(self) -> tuple[int, int, int, int] | None: ...
    @property
    def size(self) -> int: ...
    @property
    def numpy_dtype(self) -> np.dtype[Any]: ...
