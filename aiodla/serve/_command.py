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
    tls_cert: str | None,
    tls_key: str | None,
    tls_client_ca: str | None,
    priorities: dict[str, int],
    weights: dict[str, float],
    runtime: str,
    trust_compute: bool,
) -> int:
    """Serve MODELs over the KServe v2 / Triton inference protocol (HTTP and gRPC).

    Each MODEL is PATH (named after the file: det.bin serves as det) or NAME=PATH,
    with an engine of its own; several models share the cores, one feed per core
    choosing the next request by --priority, then --weight. Triton's clients
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
        )
    )
    print("aiodla serve: stopped", file=sys.stderr, flush=True)
    return 0
