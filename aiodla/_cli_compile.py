"""The ``aiodla compile`` command: :func:`aiodla.compile.compile_model` and what it
found, as lines."""

from __future__ import annotations

from typing import Any

import click

from ._cli_frame import CommandError, debug_option
from ._errors import AiodlaError

__all__ = ["compile_command"]

_HEADS = ("yolov5", "yolov5u", "yolov7", "yolov8", "yolo11", "yolox")


@click.command(
    name="compile", short_help="Cut a detector's ONNX export into a network the DLA runs whole."
)
@click.argument("model", type=click.Path(dir_okay=False, exists=True))
@click.option("-o", "--output", required=True, metavar="OUT.bin", help="The loadable to write.")
@click.option(
    "--head",
    type=click.Choice(_HEADS),
    help="The detector family, where the graph does not tell.",
)
@click.option(
    "--emulate", is_flag=True, help="Write an emulator loadable that runs the trimmed network."
)
@click.option("--int8", is_flag=True, help="Quantize with explicit Q/DQ nodes (needs --calib).")
@click.option(
    "--calib",
    type=click.Path(file_okay=False, exists=True),
    metavar="DIR",
    help="Images (PNG, JPEG, BMP or H x W x 3 uint8 .npy, RGB) to calibrate --int8 on.",
)
@click.option("--core", type=click.IntRange(0, 1), default=0, show_default=True,
              help="The DLA core the build targets.")  # fmt: skip
@debug_option
def compile_command(
    model: str,
    output: str,
    head: str | None,
    emulate: bool,
    int8: bool,
    calib: str | None,
    core: int,
) -> int:
    """Cut MODEL (a YOLOv5, YOLOv5u, YOLOv8, YOLO11 or YOLOX export) at its raw heads,
    check every remaining layer against the DLA's layer rules, quantize (--int8), and
    build OUT.bin where TensorRT is (else print the build command), or write an
    emulator loadable (--emulate). Beside it: the trimmed ONNX and OUT.bin.detect.json,
    which Detect.for_model("OUT.bin") reads. Exits 1 when a layer would not run on the
    DLA or the build failed."""
    try:
        from .compile import CompileError, compile_model
    except ImportError as exc:  # pragma: no cover (the extra's own modules import lazily)
        raise CommandError(
            f"aiodla compile needs its extra: pip install 'aiodla[compile]' ({exc})"
        ) from exc
    try:
        result = compile_model(
            model, output, head=head, emulate=emulate, int8=int8, calib=calib, core=core
        )
    except CompileError as exc:
        for finding in exc.findings:
            click.echo(f"not on the DLA  {finding}", err=True)
        raise CommandError(
            f"{len(exc.findings)} layer(s) of {model!r} would not run on the DLA (above)"
        ) from exc
    except AiodlaError as exc:
        raise CommandError(f"{model!r}: {exc}") from exc
    cut = result.cut
    heads = ", ".join(
        f"{name} {'x'.join(map(str, shape[1:]))}"
        for name, shape in zip(cut.names, cut.shapes, strict=True)
    )
    lines = [
        ("family", f"{cut.family}: {cut.classes} classes, strides {list(cut.strides)}"
                   + (f", reg_max {cut.reg_max}" if cut.family == "yolov8" else "")),
        ("cut", f"at {heads}; the tail matches the {cut.family} decode "
                f"(relative difference {cut.max_difference:.1g})"),
        ("trimmed", result.trimmed),
        ("check", "every layer fits the DLA's layer rules"),
    ]  # fmt: skip
    if result.quantized:
        lines.append(("int8", f"{result.quantized} ({len(result.calibration)} images calibrated)"))
        lines.append(("agreement", _agreement(result.agreement or {})))
    lines.append(("settings", result.settings))
    failed = False
    if result.emulated:
        network = "quantized" if result.quantized else "trimmed"
        lines.append(("loadable", f"{result.loadable} (emulator loadable: the {network} network)"))
    elif result.build is not None:
        if result.build.built:
            lines.append(("loadable", f"{result.loadable} ({result.build.reason})"))
        else:
            failed = "failed" in result.build.reason
            lines.append(("NOT BUILT", result.build.reason))
        lines.append(("command", result.build.shell))
    for label, text in lines:
        click.echo(f"{label:<10} {text}")
    return 1 if failed else 0


def _agreement(report: dict[str, Any]) -> str:
    if not report.get("fp32_detections"):
        return f"the FP32 model found nothing on {report.get('images', 0)} held-out image(s)"
    iou = report["mean_iou"]
    error = report["mean_score_error"]
    return (
        f"{report['matched']} of {report['fp32_detections']} FP32 detections matched by INT8 "
        f"({report['int8_detections']} found) on {report['images']} held-out image(s); "
        + (f"mean IoU {iou:.3f}, score error mean {error:.4f} max {report['max_score_error']:.4f}"
           if iou is not None else "none matched")
    )  # fmt: skip
