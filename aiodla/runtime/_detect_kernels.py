"""Detector post-processing on the GPU: the compiled kernels of one :class:`~aiodla.Detect`
matched to one model, and the five launches a frame takes on a stream.

The source comes from :mod:`aiodla.runtime._detect_source`; compiling, the disk cache
and launching are every program's (:class:`._conversion_kernels.CompiledKernels`). A
slot owns a scratch buffer of ``work_bytes`` and an output of ``out_bytes`` in device
memory; :meth:`DetectKernels.launch` enqueues everything after the DLA task on the
slot's stream, and the host then copies the output only (``count`` at byte 0, then
``max_det`` boxes, scores and classes at :attr:`DetectKernels.layout`'s offsets).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._conversion_kernels import CompiledKernels, _Launch, _Launcher, _Params
from ._detect_output import OutputLayout, output_layout, read_output
from ._detect_source import DetectProgram, plan_detect

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._detect import DetectPlan
    from .._frame_plan import Geometry

__all__ = ["DetectKernels", "OutputLayout", "detect_source", "read_output"]

_ORDER = (
    "aiodla_detect_reset",
    "aiodla_detect_decode",
    "aiodla_detect_rank",
    "aiodla_detect_mask",
    "aiodla_detect_select",
)
_FRAME = struct.Struct("<7Q")  # left, top, scale_x, scale_y, width, height, mapped


def detect_source(plan: DetectPlan) -> str:
    """The CUDA C++ source of the program for this plan (no GPU needed)."""
    return plan_detect(plan).source


class DetectKernels(CompiledKernels):
    """The compiled post-processing kernels of one engine's detector outputs."""

    what = "detector"

    def __init__(
        self,
        program: DetectProgram,
        launches: dict[str, _Launch],
        layout: OutputLayout,
        *,
        from_cache: bool,
        keep_alive: Any = None,
        launcher: _Launcher | None = None,
    ) -> None:
        super().__init__(from_cache=from_cache, keep_alive=keep_alive, launcher=launcher)
        self._program = program
        self._launches = launches
        self.layout = layout
        self._one = _Params(1)
        self._decode = _Params(program.heads + 1 + _FRAME.size // 8)
        self._select = _Params(2 + _FRAME.size // 8)

    @classmethod
    def compile(
        cls, plan: DetectPlan, *, device: int = 0, cache_dir: Path | None = None
    ) -> DetectKernels:
        """Compile (or take from the disk cache) the program for ``plan``.
        RuntimeUnavailableError when cuda.core, NVRTC or the device is missing or the
        compile fails (with NVRTC's log); ValueError for a head a GPU load cannot read."""
        program = plan_detect(plan)
        handles, from_cache = cls.build(program.source, _ORDER, device=device, cache_dir=cache_dir)
        launches = {name: _Launch(handles[name], program.grids[name]) for name in _ORDER}
        layout = output_layout(plan.detect.max_det)
        return cls(program, launches, layout, from_cache=from_cache, keep_alive=handles)

    @property
    def work_bytes(self) -> int:
        """Device scratch a slot needs (candidates, sorted list, suppression mask)."""
        return self._program.work_bytes

    @property
    def out_bytes(self) -> int:
        """The output buffer's size: all the host copies back."""
        return self.layout.size

    def launch(
        self,
        heads: Sequence[int],
        work: int,
        out: int,
        stream: int,
        geometry: Geometry | None = None,
        frame_size: tuple[int, int] | None = None,
    ) -> None:
        """Enqueue on ``stream`` the post-processing of the heads' DLA buffers (device
        pointers, in the plan's order) into ``out``, using ``work`` as scratch (both
        16-byte aligned). With ``geometry`` and ``frame_size`` (height, width) the boxes
        are mapped into the frame and clipped, and those with nothing inside it dropped
        before ranking and NMS. ValueError for the wrong number of heads
        or an unaligned buffer; CudaCallError when a launch fails."""
        if len(heads) != self._program.heads:
            raise ValueError(f"{len(heads)} head buffers given, the plan has {self._program.heads}")
        if work & 15 or out & 15:
            raise ValueError(f"detector buffers must be 16-byte aligned: {work:#x}, {out:#x}")
        one, decode, select = self._one, self._decode, self._select
        struct.pack_into("<Q", one.values, 0, work)
        sizes: tuple[float, ...] = (0.0,) * 6
        mapped = geometry is not None and frame_size is not None
        if geometry is not None and frame_size is not None:
            sizes = (geometry.left, geometry.top, geometry.scale_x, geometry.scale_y)
            sizes += (frame_size[1], frame_size[0])
        bits = np.array(sizes, np.float32).view(np.uint32).tolist()
        struct.pack_into(f"<{len(heads) + 1}Q", decode.values, 0, *heads, work)
        _FRAME.pack_into(decode.values, 8 * (len(heads) + 1), *bits, int(mapped))
        struct.pack_into("<QQ", select.values, 0, work, out)
        _FRAME.pack_into(select.values, 16, *bits, int(mapped))
        run = self._launches
        self._launch(run["aiodla_detect_reset"], stream, one.address)
        self._launch(run["aiodla_detect_decode"], stream, decode.address)
        self._launch(run["aiodla_detect_rank"], stream, one.address)
        self._launch(run["aiodla_detect_mask"], stream, one.address)
        self._launch(run["aiodla_detect_select"], stream, select.address)

    def _describe(self) -> str:
        return f"{self._program.heads} heads"
