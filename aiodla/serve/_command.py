"""The ``aiodla serve`` command, registered by ``aiodla._cli``.

It imports nothing of the ``serve`` extra until it runs, so the base install lists it
and, run without the extra, it says how to install it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from .._cli_frame import (
    CommandError,
    cores_option,
    count_option,
    debug_option,
    runtime_option,
    seconds_option,
    streams_option,
    trust_compute_option,
)

if TYPE_CHECKING:
    from ._app import Server

__all__ = ["serve_command"]


def _address(ctx: click.Context, param: click.Parameter, value: str) -> str | None:
    return None if value.lower() == "off" else value


def _by_name(kind: type) -> Callable[[click.Context, click.Parameter, tuple[str, ...]], Any]:
    """A callback reading repeated ``NAME=VALUE`` options into a dict (value of ``kind``)."""

    def parse(
        ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
    ) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for text in values:
            name, equals, value = text.partition("=")
            try:
                if not (name and equals):
                    raise ValueError
                found[name] = kind(value)
            except ValueError:
                raise click.BadParameter(
                    f"{text!r}: expected NAME={kind.__name__.upper()}", ctx, param
                ) from None
        return found

    return parse


class _Prefixed(logging.Formatter):
    """Each line once prefixed: ``aiodla serve: ...`` for the server's own records (as
    the lines it prints), the logger's name for a library's (``aiohttp.server: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = "aiodla serve" if record.name == "aiodla.serve" else record.name
        return f"{prefix}: {super().format(record)}"


def _log_to_stderr() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Prefixed("%(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def _floats(text: str) -> float | tuple[float, ...]:
    values = tuple(float(v) for v in text.split("/"))
    return values[0] if len(values) == 1 else values


def _size(text: str) -> tuple[int, int]:
    height, x, width = text.lower().partition("x")
    if not x:
        raise ValueError
    return int(height), int(width)


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError
    return text.lower() in ("true", "1", "yes")


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split("/"))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split("/"))


# The settings each option takes, as KEY=VALUE: ImagePreprocess's and Detect's fields of
# the same names (a list joined by "/": mean=0.485/0.456/0.406, strides=8/16/32).
_FRAME_SETTINGS: dict[str, Callable[[str], Any]] = {
    "source": str,
    "order": str,
    "resize": lambda text: None if text.lower() == "none" else text,
    "pad_value": int,
    "scale": float,
    "mean": _floats,
    "std": _floats,
    "max_frame": _size,
    "color_range": str,
}
_DETECT_SETTINGS: dict[str, Callable[[str], Any]] = {
    "head": str,
    "classes": int,
    "conf": float,
    "iou": float,
    "max_det": int,
    "class_agnostic": _flag,
    "strides": _ints,
    "reg_max": int,
    "outputs": _names,
    "max_candidates": int,
    "layout": str,
}


def _settings(
    text: str, known: dict[str, Callable[[str], Any]], ctx: click.Context, param: click.Parameter
) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for part in text.split(","):
        key, equals, value = part.partition("=")
        key = key.strip()
        if not equals or key not in known:
            raise click.BadParameter(
                f"{part!r} must be KEY=VALUE with KEY one of {', '.join(known)}", ctx, param
            )
        try:
            found[key] = known[key](value.strip())
        except ValueError:
            message = f"{part!r}: {value!r} is not a value of {key}"
            raise click.BadParameter(message, ctx, param) from None
    return found


def _build(kind: Callable[..., Any], settings: dict[str, Any], ctx: Any, param: Any) -> Any:
    from .._errors import ConfigurationError

    try:
        return kind(**settings)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    except TypeError as exc:  # a setting with no default left out
        missing = str(exc).partition("argument")[2].strip(": ") or str(exc)
        raise click.BadParameter(f"{kind.__name__} needs {missing}", ctx, param) from None


def _preprocess(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """``[MODEL/]INPUT:KEY=VALUE,...`` -> {model ("" for the only one): {input:
    ImagePreprocess}}."""
    from .._preprocess import ImagePreprocess

    found: dict[str, dict[str, Any]] = {}
    for text in values:
        where, colon, rest = text.partition(":")
        model, slash, name = where.rpartition("/")
        if not colon or not name or (slash and not model):
            raise click.BadParameter(
                f"{text!r} must be [MODEL/]INPUT:KEY=VALUE,... e.g. "
                "images:source=bgr,order=rgb,resize=letterbox",
                ctx,
                param,
            )
        settings = _settings(rest, _FRAME_SETTINGS, ctx, param)
        found.setdefault(model, {})[name] = _build(ImagePreprocess, settings, ctx, param)
    return found


def _detect(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
    """``[MODEL:]KEY=VALUE,...`` -> {model ("" for the only one): Detect}."""
    from .._detect import Detect

    found: dict[str, Any] = {}
    for text in values:
        model, colon, rest = text.partition(":")
        if not colon:
            model, rest = "", text
        if model in found:
            raise click.BadParameter(f"{text!r}: a second --detect for the same model", ctx, param)
        found[model] = _build(Detect, _settings(rest, _DETECT_SETTINGS, ctx, param), ctx, param)
    return found


def _announce(server: Server) -> None:
    # One line on stderr once both fronts listen: with port 0 it says which ports
    # were picked (scripts and tests read it).
    parts = [f"models {', '.join(server.models)}"]
    if server.http_port is not None:
        parts.append(f"HTTP port {server.http_port}")
    if server.grpc_port is not None:
        parts.append(f"gRPC port {server.grpc_port}")
    if server.tls:
        parts.append("TLS")
    print(f"aiodla serve: listening: {'; '.join(parts)}", file=sys.stderr, flush=True)


@click.command(name="serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("models", nargs=-1, required=True, metavar="MODEL...")
@click.option(
    "--http",
    default="127.0.0.1:8000",
    show_default=True,
    callback=_address,
    help="HTTP/REST address HOST:PORT (port 0: any free one), or off.",
)
@click.option(
    "--grpc",
    default="127.0.0.1:8001",
    show_default=True,
    callback=_address,
    help="gRPC address HOST:PORT, or off.",
)
@cores_option("DLA cores every model's engine uses, joined by commas.")
@streams_option
@count_option(
    "--max-queue",
    1024,
    "Requests waiting per model; beyond, requests are answered UNAVAILABLE (503).",
)
@seconds_option(
    "--drain-timeout", 30.0, "On SIGTERM, seconds that accepted requests get to finish."
)
@seconds_option(
    "--body-timeout",
    5.0,
    "Seconds a MiB an HTTP request body may take to arrive (at least a MiB's worth); a "
    "slower one is answered 408.",
    above_zero=True,
)
@seconds_option(
    "--header-timeout",
    10.0,
    "Seconds an HTTP request's headers may take to arrive (from their first byte, or "
    "from the connection's start), and a TLS handshake on either port; a slower one is "
    "answered 408 and closed.",
    above_zero=True,
)
@count_option(
    "--max-connections",
    1024,
    "HTTP connections open at once (and at most half the open-file limit); one more is "
    "answered 503. gRPC takes as many.",
)
@click.option(
    "--tls-cert",
    type=click.Path(dir_okay=False),
    metavar="PEM",
    help="Serve HTTP and gRPC over TLS only, with this certificate (chain); with --tls-key.",
)
@click.option("--tls-key", type=click.Path(dir_okay=False), metavar="PEM", help="Its private key.")
@click.option(
    "--tls-client-ca",
    type=click.Path(dir_okay=False),
    metavar="PEM",
    help="Require client certificates signed by this CA (mutual TLS), on both fronts.",
)
@click.option(
    "--priority",
    "priorities",
    multiple=True,
    metavar="NAME=P",
    callback=_by_name(int),
    help="Model NAME's priority on the shared cores (an int, higher first; default 0). Repeatable.",
)
@click.option(
    "--weight",
    "weights",
    multiple=True,
    metavar="NAME=W",
    callback=_by_name(float),
    help="Model NAME's share of core time within its priority (default 1). Repeatable.",
)
@click.option(
    "--preprocess",
    multiple=True,
    metavar="[MODEL/]INPUT:KEY=VALUE,...",
    callback=_preprocess,
    help="Serve INPUT as camera frames (UINT8 HxWx3, or NV12), pre-processed by the engine: "
    "ImagePreprocess's settings source, order, resize (letterbox, stretch or none), "
    "pad_value, scale, mean, std (one or three joined by /), max_frame (HxW, default "
    "1080x1920), color_range (limited or full, for nv12 and i420). E.g. "
    "images:source=bgr,order=rgb,resize=letterbox. MODEL/ names the "
    "model when several are served. Repeatable.",
)
@click.option(
    "--detect",
    multiple=True,
    metavar="[MODEL:]KEY=VALUE,...",
    callback=_detect,
    help="Answer with detections (boxes, scores, classes, count) of the engine's Detect: "
    "head (yolov5, yolov7, yolov8, yolo11, yolox, boxes), classes, conf, iou, max_det, "
    "class_agnostic, strides (joined by /), reg_max, outputs (joined by /), "
    "max_candidates, layout. E.g. head=yolov5,classes=80,conf=0.25. MODEL: names the "
    "model when several are served.",
)
@runtime_option("Which runtime runs the models.")
@trust_compute_option
@debug_option
def serve_command(
    models: tuple[str, ...],
    http: str | None,
    grpc: str | None,
    cores: tuple[int, ...],
    streams: int,
    max_queue: int,
    drain_timeout: float,
    body_timeout: float,
    header_timeout: float,
    max_connections: int,
    tls_cert: str | None,
    tls_key: str | None,
    tls_client_ca: str | None,
    priorities: dict[str, int],
    weights: dict[str, float],
    preprocess: dict[str, dict[str, Any]],
    detect: dict[str, Any],
    runtime: str,
    trust_compute: bool,
) -> int:
    """Serve MODELs over the KServe v2 / Triton inference protocol (HTTP and gRPC).

    Each MODEL is PATH (named after the file: det.bin serves as det) or NAME=PATH,
    with an engine of its own; several models share the cores, one feed per core
    choosing the next request by --priority, then --weight. With --preprocess and
    --detect a detector takes camera frames and answers its detections. Triton's clients
    (tritonclient.http, tritonclient.grpc) work unchanged; Prometheus metrics, per
    model, are at /metrics on the HTTP port. SIGTERM or Ctrl-C stops accepting, lets
    accepted requests finish within --drain-timeout, then exits.
    """
    if http is None and grpc is None:
        raise click.UsageError("--http and --grpc are both off: nothing to serve")
    try:  # the extra's libraries, on use only
        from ._app import serve
    except ImportError as exc:
        raise CommandError(str(exc)) from exc
    _log_to_stderr()
    asyncio.run(
        serve(
            models,
            http=http,
            grpc=grpc,
            runtime=runtime,
            drain_timeout=drain_timeout,
            body_timeout=body_timeout,
            header_timeout=header_timeout,
            max_connections=max_connections,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_client_ca=tls_client_ca,
            started=_announce,
            cores=cores,
            streams_per_core=streams,
            max_queue=max_queue,
            trust_compute=trust_compute,
            priorities=priorities,
            weights=weights,
            preprocess=preprocess,
            postprocess=detect,
        )
    )
    print("aiodla serve: stopped", file=sys.stderr, flush=True)
    return 0
