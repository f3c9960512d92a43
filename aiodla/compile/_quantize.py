"""INT8 the explicit way: Q/DQ nodes made on the CPU by onnxruntime's static
quantization, calibrated on the user's images passed through the engine's own
:class:`aiodla.ImagePreprocess`.

Why onnxruntime's ``quantize_static`` (QDQ format) and not NVIDIA's Model Optimizer:
it is already the dependency that runs the network here (``aiodla[onnx]``), it has
wheels wherever aiodla installs, and its QDQ output with symmetric INT8 scales (zero
point 0, what TensorRT's explicit quantization takes) is plain ONNX that TensorRT
reads. Model Optimizer's ONNX PTQ makes the same kind of graph with more calibration
methods, but pulls in PyTorch-sized dependencies for a step that needs none.

Calibration sees what inference sees: each image goes through ``ImagePreprocess.apply``
(the engine's numpy path, bit for bit its GPU kernel's) and is then rounded to FP16, as
the engine's FP16 input tensor stores it (:func:`calibration_inputs`). The last quarter
of the images (at least one) is held out of calibration; the quantized model's
detections on it are held against the FP32 model's (:func:`agreement`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._detect import Detect
from .._errors import ConfigurationError, ModelError
from .._preprocess import ImagePreprocess
from .._tensors import TensorSpec

__all__ = ["IMAGE_SUFFIXES", "agreement", "calibration_inputs", "quantize", "read_images"]

_Array = np.ndarray[Any, Any]
#: What ``--calib DIR`` reads: PNG/JPEG/BMP through Pillow (as RGB), .npy frames (H x W
#: x 3 uint8, RGB).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".npy")


def read_images(directory: str | os.PathLike[str]) -> list[tuple[str, _Array]]:
    """The calibration frames in ``directory`` (sorted by name), RGB uint8 H x W x 3."""
    path = os.fspath(directory)
    try:
        names = sorted(n for n in os.listdir(path) if n.lower().endswith(IMAGE_SUFFIXES))
    except OSError as exc:
        raise ConfigurationError(f"--calib {path!r}: {exc.strerror or exc}") from exc
    if len(names) < 2:
        raise ConfigurationError(
            f"--calib {path!r} holds {len(names)} images ({', '.join(IMAGE_SUFFIXES)}); "
            "calibration needs at least 2 (some are held out to check the result)"
        )
    frames = []
    for name in names:
        file = os.path.join(path, name)
        try:
            if name.lower().endswith(".npy"):
                frame = np.load(file, allow_pickle=False)
            else:
                try:
                    from PIL import Image
                except ImportError as exc:
                    raise ConfigurationError(
                        f"{file!r}: reading images needs Pillow: pip install 'aiodla[compile]'"
                    ) from exc
                with Image.open(file) as image:
                    frame = np.asarray(image.convert("RGB"))
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"--calib: cannot read {file!r}: {exc}") from exc
        if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
            raise ConfigurationError(
                f"--calib: {file!r} is {frame.dtype} {frame.shape}, not an H x W x 3 uint8 frame"
            )
        frames.append((name, frame))
    return frames


def calibration_inputs(
    frames: Sequence[_Array], preprocess: ImagePreprocess, spec: TensorSpec
) -> list[_Array]:
    """What the engine feeds the DLA for each frame: ``preprocess.apply`` rounded to
    the input tensor's FP16, as float32 (1, 3, H, W)."""
    return [preprocess.apply(frame, spec).astype(np.float16).astype(np.float32) for frame in frames]


class _Reader:
    """onnxruntime's CalibrationDataReader protocol over prepared inputs."""

    def __init__(self, name: str, inputs: Sequence[_Array]) -> None:
        self._items: Iterator[_Array] = iter(inputs)
        self._name = name

    def get_next(self) -> dict[str, _Array] | None:
        item = next(self._items, None)
        return None if item is None else {self._name: item}


def split(count: int) -> int:
    """How many of ``count`` images calibrate; the rest (a quarter, at least one) are
    held out."""
    return count - max(1, count // 4)


def quantize(source: str, target: str, name: str, inputs: Sequence[_Array]) -> None:
    """Write ``target``: ``source`` with Q/DQ nodes, calibrated on ``inputs`` (fed to the
    input ``name``). Symmetric INT8 activations and per-channel weights, biases left
    in float: TensorRT's explicit quantization."""
    try:
        from onnxruntime.quantization import (
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )
    except ImportError as exc:
        raise ModelError("--int8 needs onnxruntime: pip install 'aiodla[compile]'") from exc
    quantize_static(
        source,
        target,
        _Reader(name, inputs),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
        calibrate_method=CalibrationMethod.MinMax,
        extra_options={
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            "QuantizeBias": False,
            # the heads leave the DLA in FP16 for Detect: no Q/DQ on graph outputs
            "OpTypesToExcludeOutputQuantization": ["Conv", "Concat", "Sigmoid", "Mul", "Add"],
        },
    )


def agreement(
    fp32: str, int8: str, inputs: Sequence[_Array], detect: Detect, input_name: str
) -> dict[str, Any]:
    """The INT8 model's detections against the FP32 model's on ``inputs``
    (onnxruntime, both), matched as ``aiodla verify --export`` matches (same class,
    IoU >= 0.5, best first, each once); the mean IoU and score error of the matched."""

    from ..emulator._onnx import OnnxCompute
    from ._exporter import match

    networks = [OnnxCompute(path) for path in (fp32, int8)]
    names = networks[0].output_names
    height, width = inputs[0].shape[2:] if inputs else (0, 0)
    matched = reference = found = 0
    ious: list[float] = []
    errors: list[float] = []
    for x in inputs:
        results = []
        for network in networks:
            heads = network({input_name: x})
            shaped = [TensorSpec(n, tuple(np.shape(heads[n]))) for n in names]
            plan = detect.plan((height, width), shaped)
            results.append(plan.run([heads[s.name] for s in plan.specs]))
        want, got = results
        reference += len(want)
        found += len(got)
        count, overlaps, differences = match(
            (got.boxes, got.scores, got.classes), (want.boxes, want.scores, want.classes)
        )
        matched += count
        ious += overlaps
        errors += differences
    return {
        "images": len(inputs),
        "fp32_detections": reference,
        "int8_detections": found,
        "matched": matched,
        "mean_iou": float(np.mean(ious)) if ious else None,
        "mean_score_error": float(np.mean(errors)) if errors else None,
        "max_score_error": float(np.max(errors)) if errors else None,
    }
