"""``aiodla compile``: a detector's ONNX export into a network the DLA runs whole, the
Detect that replaces its tail, and the loadable (built, emulated, or its command).

The files, beside ``OUT.bin`` (``STEM`` is OUT without its ``.bin``):

- ``STEM.trimmed.onnx``: the export cut at its raw heads (``_heads``);
- ``STEM.int8.onnx`` with ``int8=True``: the trimmed network with Q/DQ nodes
  (``_quantize``);
- ``OUT.bin.detect.json``: the Detect settings, the pre-processing the network was
  calibrated with, the layer check, the build command (``aiodla._compiled``);
- ``OUT.bin``: with ``emulate=True`` an emulator loadable whose computation is the
  trimmed (or quantized) network; else the DLA loadable trtexec builds, where TensorRT
  is, and none where it is not (the command is then in the settings, and the result
  says this machine cannot build).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .._compiled import write_settings
from .._detect import Detect
from .._errors import AiodlaError, ModelError
from .._preprocess import ImagePreprocess
from .._tensors import TensorSpec
from ..emulator._format import make_loadable
from ._build import Build, build, find_trtexec, trtexec_command
from ._heads import HeadCut, find_heads, load, trim
from ._rules import Finding, check_layers, rules

__all__ = ["CompileError", "CompileResult", "compile_model", "default_preprocess"]

#: The service time an emulated loadable states (YOLOv5s on one Orin DLA core, about).
EMULATED_LATENCY = 0.004


class CompileError(AiodlaError, ValueError):
    """The network would not run on the DLA (``findings`` name each layer and rule)."""

    def __init__(self, message: str, findings: tuple[Finding, ...] = ()) -> None:
        super().__init__(message)
        self.findings = findings


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """What :func:`compile_model` wrote and found."""

    loadable: str
    settings: str
    trimmed: str
    quantized: str | None
    cut: HeadCut
    emulated: bool
    build: Build | None  # None with emulate
    agreement: dict[str, Any] | None  # with int8: the held-out images' report
    calibration: tuple[str, ...] = ()  # the images that calibrated (int8)

    def detect(self, **thresholds: Any) -> Detect:
        """The Detect that replaces the cut tail (as :meth:`Detect.for_model`)."""
        return Detect.for_model(self.loadable, **thresholds)


def default_preprocess(family: str) -> dict[str, Any]:
    """The pre-processing each exporter's own code uses (``ImagePreprocess`` keywords but
    ``source``): Ultralytics letterboxes RGB with 114 and scales by 1/255; YOLOX
    letterboxes BGR with 114 and feeds pixel values unscaled."""
    if family == "yolox":
        return {"order": "bgr", "resize": "letterbox", "pad_value": 114, "scale": 1.0}
    return {"order": "rgb", "resize": "letterbox", "pad_value": 114, "scale": 1 / 255}


def _stem(output: str) -> str:
    return output[: -len(".bin")] if output.endswith(".bin") else output


def compile_model(
    model: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    head: str | None = None,
    emulate: bool = False,
    int8: bool = False,
    calib: str | os.PathLike[str] | None = None,
    preprocess: dict[str, Any] | None = None,
    core: int = 0,
    latency: float = EMULATED_LATENCY,
) -> CompileResult:
    """Compile the detector export ``model`` (ONNX) into ``output`` (module docstring).

    ``head`` names the family where the graph does not tell (``"yolov5"``,
    ``"yolov5u"``, ``"yolov7"``, ``"yolov8"``, ``"yolo11"``, ``"yolox"``); ``int8`` with
    ``calib`` (a directory of images) quantizes; ``preprocess`` overrides the family's
    :class:`ImagePreprocess` keywords; ``core`` is the DLA core the build targets;
    ``latency`` the service time an emulated loadable states. ModelError when the graph
    is not a detector export aiodla knows, CompileError (with ``findings``) when a
    layer of the trimmed network breaks a DLA rule.
    """
    source, out = os.fspath(model), os.fspath(output)
    stem = _stem(out)
    trimmed_path = stem + ".trimmed.onnx"
    quantized_path = stem + ".int8.onnx" if int8 else None
    for path in (trimmed_path, quantized_path, out):
        if path is not None and os.path.abspath(path) == os.path.abspath(source):
            raise ModelError(f"-o {out!r} would overwrite the source model {source!r}")
    if int8 and calib is None:
        raise ModelError("--int8 needs --calib DIR: images to calibrate the quantization on")
    if calib is not None and not int8:
        raise ModelError("--calib is for --int8")
    import onnx

    full = load(source)
    cut = find_heads(full, head=head, where=repr(source))
    trimmed = onnx.shape_inference.infer_shapes(trim(full, cut))
    findings = tuple(check_layers(trimmed))
    if findings:
        raise CompileError(_findings_message(source, findings), findings)
    if int8 and _opset(trimmed) < _QDQ_OPSET:
        # per-channel Q/DQ (TensorRT's explicit quantization of weights) needs opset 13
        from onnx import version_converter

        trimmed = version_converter.convert_version(trimmed, _QDQ_OPSET)
    onnx.save(trimmed, trimmed_path)
    settings = cut.detect_settings()
    height, width = cut.input_size
    pre_settings = {**default_preprocess(cut.family), **(preprocess or {})}
    spec = TensorSpec(cut.input_name, (1, 3, height, width), "float16", "chw16")
    network_path = trimmed_path
    agreement_report: dict[str, Any] | None = None
    calibrated: tuple[str, ...] = ()
    if int8:
        from ._quantize import agreement, calibration_inputs, quantize, read_images, split

        assert calib is not None
        assert quantized_path is not None
        frames = read_images(calib)
        pre = ImagePreprocess(source="rgb", **pre_settings)
        inputs = calibration_inputs([frame for _, frame in frames], pre, spec)
        count = split(len(inputs))
        quantize(trimmed_path, quantized_path, cut.input_name, inputs[:count])
        quantized = onnx.shape_inference.infer_shapes(onnx.load(quantized_path))
        findings = tuple(check_layers(quantized))
        if findings:
            raise CompileError(_findings_message(quantized_path, findings), findings)
        agreement_report = agreement(
            trimmed_path, quantized_path, inputs[count:], Detect(**_detect_keywords(settings)),
            cut.input_name,
        )  # fmt: skip
        agreement_report["held_out"] = [name for name, _ in frames[count:]]
        calibrated = tuple(name for name, _ in frames[:count])
        network_path = quantized_path
    outputs = [
        TensorSpec(name, shape, "float16", "chw16")
        for name, shape in zip(cut.names, cut.shapes, strict=True)
    ]
    command = trtexec_command(
        network_path, out, inputs=[spec.shape], outputs=[s.shape for s in outputs],
        int8=int8, core=core, trtexec=find_trtexec() or "trtexec",
    )  # fmt: skip
    result_build: Build | None = None
    if emulate:
        with open(network_path, "rb") as file:
            network = file.read()
        data = make_loadable([spec], outputs, "mix", latency, onnx=network)
        with open(out, "wb") as file:
            file.write(data)
    else:
        if os.path.exists(out):
            os.remove(out)  # a stale loadable must not pass for this build's
        result_build = build(command, out, find_trtexec(), onnx=network_path, int8=int8, core=core)
    table = rules()
    document = {
        "family": head or cut.family,
        "source": source,
        "trimmed": os.path.basename(trimmed_path),
        "quantized": os.path.basename(quantized_path) if quantized_path else None,
        "precision": "int8" if int8 else "fp16",
        "emulated": emulate,
        "input": {"name": cut.input_name, "height": height, "width": width},
        "export_output": cut.output_name,
        "detect": settings,
        "preprocess": pre_settings,
        "check": {
            "tensorrt": table["tensorrt"],
            "source": table["source"],
            "findings": [],
        },
        "build": {
            "command": list(command),
            "built": result_build.built if result_build else False,
            "reason": result_build.reason if result_build else "emulated (--emulate)",
        },
        "agreement": agreement_report,
    }
    settings_file = write_settings(out, document)
    return CompileResult(
        loadable=out,
        settings=settings_file,
        trimmed=trimmed_path,
        quantized=quantized_path,
        cut=cut,
        emulated=emulate,
        build=result_build,
        agreement=agreement_report,
        calibration=calibrated,
    )


_QDQ_OPSET = 13


def _opset(model: Any) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def _detect_keywords(settings: dict[str, Any]) -> dict[str, Any]:
    keywords = dict(settings)
    keywords["strides"] = tuple(keywords["strides"])
    keywords["outputs"] = tuple(keywords["outputs"])
    if "anchors" in keywords:
        keywords["anchors"] = tuple(tuple(row) for row in keywords["anchors"])
    return keywords


def _findings_message(where: str, findings: tuple[Finding, ...]) -> str:
    lines = [f"{len(findings)} layer(s) of {where!r} would not run on the DLA:"]
    lines += [f"  {finding}" for finding in findings]
    return "\n".join(lines)
