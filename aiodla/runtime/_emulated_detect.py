"""The emulated runtime's detector post-processing: a stream operation, as the CUDA
runtime's kernels are.

``prepare_detect`` checks that the CUDA runtime could generate the program for the
plan (a head its kernels refuse fails here too, in CI) and ``detect`` queues, on the
stream, the numpy definition (:meth:`~aiodla._detect.DetectPlan.run`) over the heads'
DLA bytes in emulated device memory, writing the output buffer the kernels would
(:mod:`._detect_output`). So the work is the emulated *device's*: it runs when the
stream reaches it, on whichever thread applies the stream's effects, and is counted in
the runtime's ``device_time``, not as the host's. An exception there writes the failed
count, which fails that request alone when the host reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._errors import RuntimeUnavailableError
from ._detect_output import OutputLayout, output_layout, write_output
from ._detect_source import plan_detect
from ._timeline import _Operation

if TYPE_CHECKING:
    from .._detect import DetectPlan
    from .._frame_plan import Geometry
    from ._emulated_memory import EmulatedMemory
    from ._timeline import Timeline

__all__ = ["EmulatedDetect", "EmulatedDetectProgram"]

logger = logging.getLogger("aiodla")

_SCRATCH = 16  # the emulation needs none; a buffer is still asked for, as on the GPU


class EmulatedDetectProgram(NamedTuple):
    plan: DetectPlan
    layout: OutputLayout
    work_bytes: int
    out_bytes: int


class EmulatedDetect:
    """The runtime's part that serves ``prepare_detect`` and ``detect``."""

    def __init__(self, timeline: Timeline, memory: EmulatedMemory) -> None:
        self._timeline = timeline
        self._memory = memory

    def prepare_detect(self, plan: DetectPlan) -> EmulatedDetectProgram:
        self._timeline.cuda("prepare_detect")
        try:
            plan_detect(plan)
        except ValueError as exc:
            raise RuntimeUnavailableError(f"the GPU post-processing cannot serve: {exc}") from None
        layout = output_layout(plan.detect.max_det)
        return EmulatedDetectProgram(plan, layout, _SCRATCH, layout.size)

    def detect(
        self,
        program: EmulatedDetectProgram,
        heads: Sequence[int],
        work: int,
        out: int,
        stream: int,
        geometry: Geometry | None = None,
        frame_size: tuple[int, int] | None = None,
    ) -> None:
        self._timeline.cuda("detect")
        plan = program.plan
        if len(heads) != len(plan.specs):
            raise ValueError(f"{len(heads)} head buffers given, the plan has {len(plan.specs)}")
        device_range = self._memory.device_range
        raws = [
            device_range(pointer, spec.size, "detect")
            for pointer, spec in zip(heads, plan.specs, strict=True)
        ]
        device_range(work, program.work_bytes, "detect")
        target = device_range(out, program.out_bytes, "detect")
        queue = self._timeline.stream(stream, "detect")

        def effect() -> None:
            try:
                # float16 heads stay float16: the definition reads them exactly as
                # float32 all the same, and only the cells that may pass are widened
                # (a whole YOLOv5s head set in float32 cost about 2 ms more a frame)
                logical = [
                    spec.unpack(raw, dtype=None if spec.numpy_dtype == np.float16 else np.float32)
                    for spec, raw in zip(plan.specs, raws, strict=True)
                ]
                write_output(plan.run(logical, geometry, frame_size), program.layout, target)
            except Exception as exc:  # the request's to report, not the stream's
                logger.debug("aiodla: emulated post-processing failed: %r", exc)
                write_output(None, program.layout, target)

        self._timeline.push(queue, _Operation(effect))
