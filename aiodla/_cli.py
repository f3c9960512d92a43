"""The ``aiodla`` command line (also ``python -m aiodla``).

::

    aiodla devices                       what cuDLA this machine has, which runtime "auto" picks
    aiodla inspect MODEL [--json]        a loadable's tensors; --json writes a model spec
    aiodla emulate --like SPEC.json -o OUT
    aiodla emulate --input NAME:NxCxHxW[:DTYPE[:FORMAT]] --output ... -o OUT
                   [--compute MODULE:FUNCTION]
    aiodla record MODEL --inputs DIR -o RECORDING.npz [--runtime ...]
    aiodla bench MODEL [--cores 0,1] [--streams N] [--concurrency N]
                       [--requests N | --duration S] [--json] [--runtime ...] [--trace T.json]
    aiodla serve MODEL [NAME=MODEL ...] [--http HOST:PORT] [--grpc HOST:PORT]   (aiodla[serve])

Errors are one line on stderr naming the cause, with exit status 1 (2 for a bad
argument, 130 when interrupted); ``--debug`` adds the traceback.

The model spec that ``inspect --json`` writes and ``emulate --like`` reads is
described, read and written in ``aiodla.emulator._spec``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from . import __version__
from ._bench import failure_message, progress_bar, run_bench, summary_lines
from ._cli_compile import compile_command
from ._cli_doctor import doctor_command
from ._cli_frame import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    CommandError,
    ErrorReportingGroup,
    cores_option,
    debug_option,
    one_line,
    runtime_option,
    streams_option,
    trust_compute_option,
)
from ._cli_trace import trace_option, trace_plot
from ._cli_verify import verify_command
from ._cli_watch import watch_command
from ._descriptors import TensorDescriptor
from ._engine import Engine
from ._errors import DeviceError, ModelError, status_name
from ._inspection import (
    auto_choice,
    close_runtime,
    describe_module,
    describe_runtime,
    dla_resources,
    version_text,
)
from ._local_device import read_model
from ._tensors import TensorSpec
from .emulator._detector import PRESETS, PRESETS_HELP, preset_io
from .emulator._format import (
    AUTO,
    MAGIC,
    OPS,
    EmulatorModel,
    is_compute_reference,
    is_emulator_loadable,
    make_loadable,
    parse_loadable,
)
from .emulator._recording import record_samples, write_recording
from .emulator._spec import (
    DEFAULT_LATENCY,
    DESCRIPTOR_FIELDS,
    is_spec_document,
    read_spec,
    read_spec_document,
    restated,
    spec_document,
)
from .runtime import _select
from .serve._command import serve_command

__all__ = ["cli", "main", "read_spec_document"]


@click.group(
    cls=ErrorReportingGroup,
    name="aiodla",
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, prog_name="aiodla")
@debug_option
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Share NVIDIA's Deep Learning Accelerator between asyncio coroutines."""
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``aiodla`` console script."""
    cli.main(argv, prog_name="aiodla")


def _console() -> Any:
    """The console for standard output (a seam: tests force its terminal detection)."""
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console.width = 160  # a pipe or a file has no width: keep table rows whole
    return console


def _error_console() -> Any:
    """The console for standard error (a seam, as :func:`_console`)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


# -- reading models -------------------------------------------------------------------------


def _read_model(path: str) -> bytes:
    try:
        return read_model(path)
    except ModelError as exc:
        raise CommandError(str(exc)) from exc


def _emulator_model(path: str, data: bytes) -> EmulatorModel:
    try:
        return parse_loadable(data)
    except ModelError as exc:
        raise CommandError(f"{path!r}: {exc}") from exc


def _dla_descriptors(
    path: str, data: bytes
) -> tuple[Sequence[TensorDescriptor], Sequence[TensorDescriptor]]:
    """Ask cuDLA for a DLA loadable's tensors: load it on core 0, read, unload."""
    try:
        _select.refuse_foreign_model(data, repr(path))
    except ModelError as exc:
        raise CommandError(str(exc)) from exc
    usable, reason, _standin = _select.cuda_probe()
    if not usable:
        raise CommandError(_select.not_an_emulator_loadable(repr(path), reason))
    runtime, _owned = _select.select_runtime("cuda", data)
    try:
        return describe_module(runtime, data)
    except DeviceError as exc:
        if exc.status is not None:
            raise CommandError(
                f"cuDLA cannot load {path!r} ({status_name(exc.status)}): it is not a "
                "loadable for this DLA"
            ) from exc
        raise CommandError(f"{path!r}: {exc}") from exc
    finally:
        close_runtime(runtime)


# -- devices --------------------------------------------------------------------------------


@cli.command(short_help="Show cuDLA, its DLA cores and what 'auto' picks.")
@click.option("--ray-resources", is_flag=True, help="Print what 'ray start --resources' takes.")
@debug_option
def devices(ray_resources: bool) -> None:
    """Show the cuDLA runtime, its DLA cores, and which runtime "auto" picks."""
    if ray_resources:  # JSON for `ray start --resources "$(aiodla devices --ray-resources)"`
        click.echo(json.dumps(dla_resources()))
        return
    usable, reason, standin = _select.cuda_probe()
    if usable:
        runtime, _owned = _select.select_runtime("cuda", b"")
        try:
            version, cores = describe_runtime(runtime)
        finally:
            close_runtime(runtime)
        which = "aiodla's GPU stand-in (a test double)" if standin else "libcudla.so.1"
        click.echo(f"cuDLA:      {which}, version {version_text(version)}")
        click.echo(f"DLA cores:  {cores}")
    else:
        click.echo(f"cuDLA:      not available: {reason}")
        click.echo(
            "DLA cores:  none; emulator loadables run on the emulated runtime "
            f"({_select.ORIN_DLA_CORES} emulated cores)"
        )
    click.echo('runtime="auto" picks')
    dla_choice = auto_choice(b"") if usable else "none: a DLA loadable needs cuDLA"
    click.echo(f"  for a DLA loadable:       {dla_choice}")
    click.echo(f"  for an emulator loadable: {auto_choice(MAGIC)}")


# -- inspect ----------------------------------------------------------------------------------


@cli.command(short_help="Show a loadable's input and output tensors.")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a model spec (JSON) that 'aiodla emulate --like' accepts.",
)
@debug_option
def inspect(model: str, as_json: bool) -> None:
    """Show every input and output tensor of the loadable MODEL.

    Emulator loadables and model specs (what --json writes) are read anywhere; a DLA
    loadable needs cuDLA (a Jetson).
    """
    data = _read_model(model)
    if is_spec_document(data):
        document = restated(data, repr(model))
        title = f"{model}: model spec of {document['model']} ({document['loadable']} loadable)"
    else:
        emulator = _emulator_model(model, data) if is_emulator_loadable(data) else None
        descriptors = _dla_descriptors(model, data) if emulator is None else emulator.descriptors
        document = spec_document(model, descriptors, emulator)
        title = (
            f"{model}: DLA loadable"
            if emulator is None
            else (
                f"{model}: emulator loadable, op {emulator.op} (scale {emulator.scale:g}, bias "
                f"{emulator.bias:g}), {emulator.latency * 1e3:.3f} ms per task on one core"
                + (
                    f", computed by {emulator.compute} (imported only with trust_compute)"
                    if emulator.compute
                    else f", computed by its ONNX network ({len(emulator.onnx)} bytes)"
                    if emulator.onnx
                    else ""
                )
            )
        )
    if as_json:
        click.echo(json.dumps(document, indent=2))
        return
    from rich.table import Table

    console = _console()
    console.print(title)
    table = Table(box=None, pad_edge=False)
    for column in ("", "name", "shape", "dtype", "format", "strides"):
        table.add_column(column)
    table.add_column("bytes", justify="right")
    problems = []
    for direction in ("inputs", "outputs"):
        for entry in document[direction]:
            strides = entry["strides"] or entry["descriptor"]["stride"][:4]
            table.add_row(
                direction[:-1],
                entry["name"],
                "x".join(map(str, entry["shape"])),
                entry["dtype"] or "?",
                entry["format"] or "?",
                " ".join(map(str, strides)),
                str(entry["bytes"]),
            )
            if "problem" in entry:
                problems.append(entry["problem"])
    console.print(table)
    console.print("strides: bytes from one pixel, line, surface (channel group), image to the next")
    for problem in problems:
        console.print(f"aiodla cannot serve this model: {problem}")


# -- emulate ----------------------------------------------------------------------------------

_SHAPE = re.compile(r"^\d+x\d+x\d+x\d+$")


def _parse_tensor(text: str) -> TensorSpec:
    """``NAME:NxCxHxW[:DTYPE[:FORMAT]]``; the name may itself contain ':' (e.g. "in:0")."""
    parts = text.split(":")
    at = max((i for i, part in enumerate(parts) if _SHAPE.match(part)), default=None)
    if at is None or at == 0 or len(parts) - at > 3:
        raise click.BadParameter(
            f"{text!r} must be NAME:NxCxHxW[:DTYPE[:FORMAT]], e.g. image:1x3x224x224:float16:chw16"
        )
    name, shape = ":".join(parts[:at]), tuple(int(d) for d in parts[at].split("x"))
    rest = parts[at + 1 :]
    dtype = rest[0] if rest else "float16"
    fmt = rest[1] if len(rest) > 1 else "nchw"
    try:
        return TensorSpec(name, shape, dtype, fmt)  # type: ignore[arg-type]
    except ModelError as exc:
        raise click.BadParameter(f"{text!r}: {exc}") from None


def _tensors_option(
    ctx: click.Context, param: click.Parameter, values: Sequence[str]
) -> list[TensorSpec]:
    return [_parse_tensor(value) for value in values]


@cli.command(short_help="Write an emulator loadable of a model's I/O.")
@click.option(
    "--like",
    "like",
    metavar="SPEC.json",
    type=click.Path(dir_okay=False),
    help="Copy the tensors of a model spec ('aiodla inspect MODEL --json').",
)
@click.option("--preset", type=click.Choice(sorted(PRESETS)), help=PRESETS_HELP)
@click.option(
    "--input",
    "inputs",
    metavar="NAME:NxCxHxW[:DTYPE[:FORMAT]]",
    multiple=True,
    callback=_tensors_option,
    help="An input tensor (repeat for more); DTYPE defaults to float16, FORMAT "
    "(nchw, nhwc, chw16, chw32, hwc4) to nchw.",
)
@click.option(
    "--output",
    "outputs",
    metavar="NAME:NxCxHxW[:DTYPE[:FORMAT]]",
    multiple=True,
    callback=_tensors_option,
    help="An output tensor (repeat for more); affine and mean_hw pair output i with input i.",
)
@click.option(
    "--op",
    type=click.Choice((AUTO, *OPS)),
    help="y = scale*x + bias (affine), its mean over H and W (mean_hw), or every "
    "output a hash of all inputs and its position (mix, any I/O). Default: the "
    "spec's op, else auto: affine or mean_hw when the shapes fit, mix otherwise.",
)
@click.option(
    "--latency",
    type=click.FloatRange(min=0, max=3600),
    metavar="S",
    help=f"Seconds one task occupies one core (default {DEFAULT_LATENCY}).",
)
@click.option("--scale", type=float, help="The op's scale (default 1).")
@click.option("--bias", type=float, help="The op's bias (default 0).")
@click.option(
    "--compute",
    metavar="MODULE:FUNCTION",
    help="A Python function that computes the outputs instead of the op (inputs by "
    "name in, outputs by name out); the emulated runtime imports it when it loads "
    "the loadable.",
)
@click.option(
    "-o",
    "--out",
    "out",
    required=True,
    metavar="OUT",
    type=click.Path(dir_okay=False),
    help="Where to write the loadable.",
)
@debug_option
def emulate(
    like: str | None,
    preset: str | None,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    op: str | None,
    latency: float | None,
    scale: float | None,
    bias: float | None,
    compute: str | None,
    out: str,
) -> None:
    """Write an emulator loadable, to run a model's I/O where there is no DLA."""
    if compute is not None and not is_compute_reference(compute):
        raise click.BadParameter(
            f"{compute!r} must be MODULE:FUNCTION, e.g. myapp.reference:detector",
            param_hint="--compute",
        )
    settings: dict[str, Any] = {}
    if like is not None:
        if inputs or outputs or preset:
            raise click.UsageError("give --like, --preset, or --input and --output: not both")
        input_descs, output_descs, settings = read_spec(like)
        inputs = [_spec_from(like, d) for d in input_descs]
        outputs = [_spec_from(like, d) for d in output_descs]
    elif preset is not None:
        if inputs or outputs:
            raise click.UsageError("give --preset, or --input and --output: not both")
        inputs, outputs, settings = preset_io(preset)
    elif not inputs or not outputs:
        raise click.UsageError("give --like SPEC.json, or at least one --input and one --output")
    chosen_op = op or (settings.get("op") if settings.get("op") in OPS else None) or AUTO
    data = make_loadable(
        inputs,
        outputs,
        chosen_op,
        latency=_setting(latency, settings, "latency", DEFAULT_LATENCY),
        scale=_setting(scale, settings, "scale", 1.0),
        bias=_setting(bias, settings, "bias", 0.0),
        compute=compute,
    )
    try:
        with open(out, "wb") as file:
            file.write(data)
    except OSError as exc:
        raise CommandError(f"cannot write {out!r}: {exc.strerror or exc}") from exc
    model = parse_loadable(data)
    computed = f"computed by {compute}" if compute else f"op {model.op}"
    click.echo(
        f"wrote {out}: {len(inputs)} input(s), {len(outputs)} output(s), {computed}, "
        f"{model.latency * 1e3:.3f} ms per task ({len(data)} bytes)"
    )


# -- record -------------------------------------------------------------------------------------


@cli.command(short_help="Run inputs through a model and save them with its outputs.")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option(
    "--inputs",
    "inputs_dir",
    required=True,
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="One sample per file, in name order: *.npz with an array per input name, "
    "or *.npy for a model with one input.",
)
@click.option(
    "-o",
    "--out",
    "out",
    required=True,
    metavar="RECORDING.npz",
    type=click.Path(dir_okay=False),
    help="Where to write the recording (for compute=aiodla.emulator.replay(...)).",
)
@runtime_option()
@trust_compute_option
@debug_option
def record(model: str, inputs_dir: str, out: str, runtime: str, trust_compute: bool) -> None:
    """Run the samples in DIR through MODEL and write them, with the outputs it gave
    and the model spec, to RECORDING.npz.

    On the Jetson, with the real loadable; in CI, compute=aiodla.emulator.replay(
    "RECORDING.npz") answers those inputs with exactly those outputs.
    """
    data = _read_model(model)
    if is_spec_document(data):
        raise CommandError(f"{model!r} is a model spec, not a loadable: record runs a loadable")
    emulator = _emulator_model(model, data) if is_emulator_loadable(data) else None
    recording = record_samples(Engine, data, inputs_dir, runtime, trust_compute=trust_compute)
    samples, results, inputs = asyncio.run(recording)
    # The spec as 'inspect --json' writes it, from the loadable's own descriptors.
    descriptors = _dla_descriptors(model, data) if emulator is None else emulator.descriptors
    document = spec_document(model, descriptors, emulator)
    try:
        write_recording(out, document, inputs, samples, results)
    except OSError as exc:
        raise CommandError(f"cannot write {out!r}: {exc.strerror or exc}") from exc
    click.echo(f"wrote {out}: {len(samples)} sample(s) of {model}")


def _spec_from(path: str, desc: TensorDescriptor) -> TensorSpec:
    try:
        spec = TensorSpec.from_descriptor(desc)
    except ModelError as exc:
        raise CommandError(f"{path!r}: {exc}") from exc
    written = spec.to_descriptor()
    for field in DESCRIPTOR_FIELDS:
        wanted, got = getattr(desc, field), getattr(written, field)
        if wanted != got:
            # Emulator loadables derive some fields from the layout; say so, never hide it.
            click.echo(
                f"aiodla: warning: tensor {desc.name!r}: {field} {wanted} is written as {got}",
                err=True,
            )
    return spec


def _setting(given: float | None, settings: dict[str, Any], key: str, default: float) -> float:
    if given is not None:
        return given
    value = settings.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return default


# -- bench --------------------------------------------------------------------------------------


@cli.command(short_help="Measure throughput and latency of a loadable.")
@click.argument("model", type=click.Path(dir_okay=False))
@cores_option("DLA cores to use, joined by commas.")
@streams_option
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    help="Requests in flight at once [default: cores x streams, every slot].",
)
@click.option(
    "--requests", type=click.IntRange(min=1), help="Send this many requests [default: 1000]."
)
@click.option(
    "--duration",
    type=click.FloatRange(min=0, min_open=True),
    metavar="S",
    help="Send requests for S seconds instead.",
)
@runtime_option()
@trust_compute_option
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON, no bar.")
@trace_option
@debug_option
def bench(
    model: str,
    cores: tuple[int, ...],
    streams: int,
    concurrency: int | None,
    requests: int | None,
    duration: float | None,
    runtime: str,
    trust_compute: bool,
    as_json: bool,
    trace: str | None,
) -> int:
    """Measure throughput and latency of MODEL on the DLA cores.

    Shows a progress bar on a terminal (on stderr with --json), then a summary:
    throughput against the ideal, what limited it, latency percentiles, per-core
    utilization and errors. Ctrl-C stops the run and prints what it measured so far
    (exit status 130). Exits with status 1 when any request failed.
    """
    if requests is not None and duration is not None:
        raise click.UsageError("give --requests or --duration, not both")
    if requests is None and duration is None:
        requests = 1000
    data = _read_model(model)
    if is_spec_document(data):
        raise CommandError(
            f"{model!r} is a model spec, not a loadable; write an emulator "
            f"loadable of it with 'aiodla emulate --like {model} -o OUT'"
        )
    if is_emulator_loadable(data):
        _emulator_model(model, data)  # a malformed one fails here, naming the file
    # The bar goes where people look: beside the summary, or on stderr when stdout
    # carries JSON for a program.
    console = _error_console() if as_json else _console()
    total = float(requests if requests is not None else duration)  # type: ignore[arg-type]
    open_engine = functools.partial(
        Engine,
        data,
        cores=cores,
        streams_per_core=streams,
        runtime=runtime,
        trust_compute=trust_compute,
    )
    with progress_bar(console, total, console.is_terminal) as progress:
        result = asyncio.run(
            run_bench(
                open_engine,
                model,
                data,
                cores=cores,
                streams=streams,
                concurrency=concurrency or len(cores) * streams,
                requests=requests,
                duration=duration,
                runtime=runtime,
                progress=progress,
                trace=trace,
            )
        )
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for label, text in summary_lines(result):
            click.echo(f"{label:<11} {text}")
    if result["interrupted"]:
        click.echo("aiodla: interrupted", err=True)
        return EXIT_INTERRUPTED
    if result["failed"]:
        click.echo(one_line(failure_message(result)), err=True)
        return EXIT_FAILURE
    return 0


for _command in (
    serve_command,
    doctor_command,
    verify_command,
    trace_plot,
    compile_command,
    watch_command,
):
    cli.add_command(_command)  # (serve imports its extra on use)
