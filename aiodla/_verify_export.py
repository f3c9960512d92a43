"""``aiodla verify --export``: a compiled detector end to end against its original export.

The loadable runs on each core with the Detect that ``aiodla compile`` wrote beside it
(:meth:`aiodla.Detect.for_model`); the reference is the *full* export on onnxruntime,
its own output decoded as its exporter documents (:func:`aiodla.compile.exporter_detections`:
Ultralytics' ``(1, 4 + C, N)`` or ``(1, N, 5 + C)`` with its NMS, YOLOX's
``postprocess``), for the same FP16-rounded input the DLA reads: the ``--input`` given,
else synthetic camera scenes through the model's compiled ``ImagePreprocess``. Per core: each
reference detection is matched to the core's detection of its class with the best IoU
(at least 0.5, each used once); reported are the matched count both ways, the mean and
least IoU and the largest score difference. A core passes when it matches at least
:data:`MIN_MATCHED` of the reference's detections and of its own, for the model's
precision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._compiled import read_settings
from ._detect import Detect
from ._engine import Engine
from ._errors import AiodlaError, ConfigurationError

__all__ = ["MIN_MATCHED", "against_export"]

#: The share of detections that must match, both ways, by precision: FP16 heads move a
#: candidate near the threshold or a near-tie in NMS; INT8 moves more.
MIN_MATCHED = {"fp16": 0.95, "int8": 0.8}


class ExportError(AiodlaError, ValueError):
    """The export does not fit the compiled model (no settings, other I/O)."""


def scenes(document: Mapping[str, Any], count: int) -> list[dict[str, np.ndarray[Any, Any]]]:
    """``count`` inputs as the engine makes them from camera frames: synthetic scenes (a
    gradient, a few boxes of colour, sensor noise; 3:4 of the model's size, so the
    letterbox pads) through the ``ImagePreprocess`` the model was compiled with. A
    detector, INT8 above all, is judged on inputs of its own range, not on noise."""
    from ._preprocess import ImagePreprocess
    from ._tensors import TensorSpec

    name, height, width = (document["input"][k] for k in ("name", "height", "width"))
    spec = TensorSpec(name, (1, 3, height, width), "float16", "chw16")
    pre = ImagePreprocess(source="rgb", **document["preprocess"])
    rng = np.random.default_rng(2024)
    rows, columns = max(1, height * 3 // 4), width
    out = []
    for _ in range(count):
        ramp = np.linspace(0, 255, columns)[None, :, None] * rng.random(3)
        frame = np.broadcast_to(ramp, (rows, columns, 3)).copy()
        for _ in range(4):
            y, x = rng.integers(0, rows), rng.integers(0, columns)
            h, w = (
                rng.integers(rows // 8 + 1, rows // 2 + 2),
                rng.integers(columns // 8 + 1, columns // 2 + 2),
            )
            frame[y : y + h, x : x + w] = rng.integers(0, 256, 3)
        frame += rng.normal(0, 8, frame.shape)
        pixels = np.clip(frame, 0, 255).astype(np.uint8)
        out.append({name: pre.apply(pixels, spec)})
    return out


async def against_export(
    data: bytes,
    model: str,
    export: str,
    samples: Sequence[Mapping[str, np.ndarray[Any, Any]]] | None,
    cores: Sequence[int],
    precision: str,
    options: Mapping[str, Any],
    *,
    count: int = 8,
) -> dict[str, Any]:
    """The report's ``detections`` entry (module docstring); ``samples`` None: ``count``
    generated scenes (:func:`scenes`)."""
    from .compile._exporter import exporter_detections, match
    from .emulator._onnx import OnnxCompute

    try:
        document = read_settings(model)
        detect = Detect.for_model(model)
    except ConfigurationError as exc:
        raise ExportError(f"--export compares a compiled detector: {exc}") from exc
    family = document["detect"]["head"]
    # an INT8 network keeps FP16 I/O: the tensors do not tell its precision, compile does
    precision = str(document.get("precision", precision))
    input_name = document["input"]["name"]
    try:
        full = OnnxCompute(export)
    except AiodlaError as exc:
        raise ExportError(f"--export: {exc}") from exc
    output = document.get("export_output") or full.output_names[0]
    if full.input_names != (input_name,) or output not in full.output_names:
        raise ExportError(
            f"--export {export!r} has inputs {list(full.input_names)} and outputs "
            f"{list(full.output_names)}; the compiled model was cut from an export with "
            f"input {input_name!r} and output {output!r}"
        )
    if samples is None:
        samples = scenes(document, count)
    references = []
    for sample in samples:
        seen = np.asarray(sample[input_name]).astype(np.float16).astype(np.float32)
        result = full({input_name: seen})[output]
        references.append(
            exporter_detections(
                family, result, conf=detect.conf, iou=detect.iou, max_det=detect.max_det
            )
        )
    wanted = sum(len(r[1]) for r in references)
    per_core: dict[str, Any] = {}
    threshold = MIN_MATCHED.get(precision, MIN_MATCHED["int8"])
    for core in cores:
        async with Engine(
            data, cores=[core], streams_per_core=1, postprocess=detect, **options
        ) as engine:
            found = [await engine.infer(dict(sample)) for sample in samples]
        matched = 0
        ious: list[float] = []
        errors: list[float] = []
        for got, want in zip(found, references, strict=True):
            count, i, e = match((got.boxes, got.scores, got.classes), want)
            matched += count
            ious += i
            errors += e
        own = sum(len(g) for g in found)
        recall = matched / wanted if wanted else 1.0
        precision_share = matched / own if own else 1.0
        per_core[str(core)] = {
            "reference": wanted,
            "found": own,
            "matched": matched,
            "mean_iou": float(np.mean(ious)) if ious else None,
            "min_iou": float(np.min(ious)) if ious else None,
            "max_score_difference": float(np.max(errors)) if errors else None,
            "pass": recall >= threshold and precision_share >= threshold,
        }
    return {
        "export": export,
        "family": family,
        "precision": precision,
        "min_matched": threshold,
        "samples": len(samples),
        "cores": per_core,
        "pass": all(entry["pass"] for entry in per_core.values()),
    }
