"""The ``aiodla verify`` command: ``_verify``'s steps, its report as lines, Markdown
(``--report``) or JSON (``--json``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import click

from ._cli_frame import (
    EXIT_FAILURE,
    CommandError,
    cores_option,
    count_option,
    debug_option,
    runtime_option,
    trust_compute_option,
)
from ._errors import AiodlaError, ModelError
from ._local_device import read_model
from ._safe_paths import write_regular
from ._verify import VerifyError, VerifySettings, verify
from ._verify_report import report_markdown, summary_lines

__all__ = ["verify_command"]


def _pairs(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> dict[str, str]:
    pairs = {}
    for value in values:
        name, sep, rest = value.rpartition("=")
        if not sep or not name or not rest:
            raise click.BadParameter(f"{value!r} must be NAME=VALUE, e.g. image=frame.npy")
        pairs[name] = rest
    return pairs


def _scales(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> dict[str, float]:
    scales = {}
    for name, text in _pairs(ctx, param, values).items():
        try:
            scales[name] = float(text)
        except ValueError:
            raise click.BadParameter(f"{name}={text}: the scale must be a number") from None
    return scales


@click.command(name="verify", short_help="Check a loadable's answers and speed on each core.")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option(
    "--onnx",
    type=click.Path(dir_okay=False, exists=True),
    help="The ONNX model the loadable was built from: onnxruntime is the reference.",
)
@click.option(
    "--export",
    type=click.Path(dir_okay=False, exists=True),
    help="The full detector export MODEL was compiled from (aiodla compile): the "
    "detections of MODEL + Detect against the export's own, decoded as its exporter does.",
)
@click.option(
    "--input",
    "inputs",
    multiple=True,
    metavar="NAME=FILE.npy",
    callback=_pairs,
    help="An input array (repeat per input); the others are generated.",
)
@click.option(
    "--scale",
    "scales",
    multiple=True,
    metavar="NAME=S",
    callback=_scales,
    help="The quantization scale of an INT8 tensor (real = S * stored).",
)
@cores_option("DLA cores to open the model on, joined by commas.")
@count_option("--samples", 8, "Generated samples (without --input).")
@count_option(
    "--requests",
    100,
    "Requests one at a time per core for the latency (four times as many for the throughput).",
)
@runtime_option()
@trust_compute_option
@click.option("--report", metavar="REPORT.md", help="Write the report as Markdown here.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@debug_option
def verify_command(
    model: str,
    onnx: str | None,
    export: str | None,
    inputs: dict[str, str],
    scales: dict[str, float],
    cores: tuple[int, ...],
    samples: int,
    requests: int,
    runtime: str,
    trust_compute: bool,
    report: str | None,
    as_json: bool,
) -> int:
    """Open MODEL on each core, run the inputs, and report: the cores agree to the
    byte; against onnxruntime on --onnx, per output the max abs and relative error,
    cosine similarity and top-1 agreement (classifiers), judged by the precision's
    tolerances; latency per core and the throughput against cores / latency; the
    versions 'aiodla doctor' reads. With --export (a detector compiled by 'aiodla
    compile'), per core the detections of MODEL + Detect.for_model(MODEL) against the
    full export's own, decoded as its exporter does: matched boxes, IoU and score
    differences. Exits 1 when the verdict is fail.
    """
    try:
        data = read_model(model)
    except ModelError as exc:
        raise CommandError(str(exc)) from exc
    settings = VerifySettings(
        model=model,
        onnx=onnx,
        export=export,
        inputs=inputs,
        scales=scales,
        cores=cores,
        runtime=runtime,
        trust_compute=trust_compute,
        samples=samples,
        latency_requests=requests,
        throughput_requests=4 * requests,
    )
    try:
        document = asyncio.run(verify(data, settings))
    except VerifyError as exc:
        raise CommandError(str(exc)) from exc
    except AiodlaError as exc:
        raise CommandError(f"{model!r}: {exc}") from exc
    if report is not None:
        try:
            write_regular(report, report_markdown(document).encode("utf-8"))
        except OSError as exc:
            raise CommandError(f"cannot write {report!r}: {exc.strerror or exc}") from exc
    if as_json:
        click.echo(json.dumps(document, indent=2))
    else:
        for line in summary_lines(document):
            click.echo(line)
    return 0 if document["verdict"] == "pass" else EXIT_FAILURE
