"""The served models and the server's lifecycle, shared by the HTTP and gRPC fronts.

:class:`Server` holds one open :class:`~aiodla.Engine` per model name and serves them
over both fronts of the KServe v2 protocol (:mod:`._http`, :mod:`._grpc`). Every
inference passes :meth:`Server.infer` on the event loop that runs the engines, so one
admission path serves both protocols: ``Engine.infer_nowait``, so a full queue is
answered at once (UNAVAILABLE) instead of parking the request in the server.

Shutdown (:meth:`Server.stop`, SIGTERM under ``aiodla serve``): both fronts stop
accepting connections and calls at once, readiness turns false, requests already
accepted (counted on arrival: an HTTP request's headers, a gRPC call's message) run
to their answer within ``drain_timeout``; any still running then, an HTTP body still
arriving included, are answered UNAVAILABLE, never dropped. Engines belong to the
caller: :func:`serve` closes the ones it opened after the fronts are down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from .. import __version__
from .._detect import Detect
from .._engine import Engine
from .._errors import ConfigurationError
from .._preprocess import ImagePreprocess
from .._shared_cores import Cores
from ..runtime import Runtime
from ._deps import MISSING_EXTRA  # first: a base install is told which extra it lacks

# isort: split
from ._connections import HEADER_TIMEOUT, MAX_CONNECTIONS
from ._grpc import GrpcFront
from ._http import HttpFront
from ._kserve import ProtocolError, Status, WireTensor, error_of, request_limit
from ._log import rate_limited
from ._served import VERSION, ServedModel
from ._tls import Tls

__all__ = [
    "MISSING_EXTRA",
    "ServeStatistics",
    "ServedModel",
    "Server",
    "parse_address",
    "parse_model",
    "serve",
]

logger = logging.getLogger("aiodla.serve")

_Array = np.ndarray[Any, Any]

SERVER_NAME = "aiodla"
#: Seconds a MiB a request body may take to arrive by default: 0.2 MiB/s at the least.
BODY_TIMEOUT = 5.0
#: The protocol extensions both fronts implement.
EXTENSIONS = ("binary_tensor_data",)


def parse_address(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigurationError(f"{what} address {text!r} must be HOST:PORT, e.g. 127.0.0.1:8000")
    return host, int(port)


def front_address(text: str | None, what: str) -> tuple[str, int] | None:
    """A front's address: None for None or ``"off"`` (that front left out, as the command
    line's ``--grpc off``), else :func:`parse_address`'s (host, port)."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "off"):
        return None
    return parse_address(text, what)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def parse_model(text: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` (named after the file's stem: ``det.bin`` is ``det``)."""
    name, sep, path = text.partition("=")
    if not sep:
        name, path = Path(text).stem, text
    if not name or not path or "/" in name:
        raise ConfigurationError(f"model {text!r} must be PATH or NAME=PATH")
    return name, path


@dataclasses.dataclass(frozen=True)
class ServeStatistics:
    """Inference requests the server took, and how they ended.

    ``received == succeeded + sum(failed.values()) + in_flight`` always holds;
    ``failed`` counts by protocol status (``INVALID_ARGUMENT``, ``NOT_FOUND``,
    ``RESOURCE_EXHAUSTED``, ``UNAVAILABLE``, ``DEADLINE_EXCEEDED`` (an HTTP body too
    slow included), ``INTERNAL``) and ``CANCELLED`` for requests whose caller went away
    (a gRPC deadline or cancellation, an HTTP client gone before its body arrived).
    """

    received: int
    succeeded: int
    failed: Mapping[str, int]
    in_flight: int


class Server:
    """The KServe v2 protocol over HTTP and gRPC for open engines, one per model name.

    ``http`` and ``grpc`` are ``HOST:PORT`` addresses (port 0: any free port, read it
    from :attr:`http_port` / :attr:`grpc_port` once started), or None (or ``"off"``, as
    on the command line) to leave that front out. An HTTP request body must arrive
    within ``body_timeout`` seconds a MiB (at least one MiB's worth), else it is
    answered 408.

    ``tls_cert`` and ``tls_key`` (PEM files) make both fronts serve TLS only;
    ``tls_client_ca`` then requires a client certificate signed by that CA. There is
    no other authentication: without it, anyone who reaches the ports may infer. Start
    and stop it on the engines' event loop::

        async with Engine("det.bin") as engine, Server({"det": engine}) as server:
            await stopped.wait()
    """

    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        http: str | None = "127.0.0.1:8000",
        grpc: str | None = "127.0.0.1:8001",
        drain_timeout: float = 30.0,
        body_timeout: float = BODY_TIMEOUT,
        header_timeout: float = HEADER_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_client_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        if not engines:
            raise ConfigurationError("serve at least one model")
        http_address = front_address(http, "HTTP")
        grpc_address = front_address(grpc, "gRPC")
        if http_address is None and grpc_address is None:
            raise ConfigurationError("give an HTTP or a gRPC address, or both")
        if not drain_timeout >= 0:
            raise ConfigurationError(f"{drain_timeout=} must be >= 0 seconds")
        if not body_timeout > 0:
            raise ConfigurationError(f"{body_timeout=} must be > 0 seconds a MiB")
        if not header_timeout > 0:
            raise ConfigurationError(f"{header_timeout=} must be > 0 seconds")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int):
            raise ConfigurationError(f"{max_connections=} must be an integer")
        if max_connections < 1:
            raise ConfigurationError(f"{max_connections=} must be >= 1")
        self._engines = dict(engines)
        self._http_address = http_address
        self._grpc_address = grpc_address
        self._drain_timeout = drain_timeout
        self._body_timeout = body_timeout
        self._header_timeout = header_timeout
        self._max_connections = max_connections
        self._tls = Tls.load(tls_cert, tls_key, tls_client_ca)
        self._models: dict[str, ServedModel] = {}
        self._accepting = False
        self._received = 0
        self._succeeded = 0
        self._failed: dict[str, int] = {}
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._futures: set[asyncio.Future[Any]] = set()
        self._forced: set[asyncio.Future[Any]] = set()
        self._http: Any = None
        self._grpc: Any = None
        self._stopping: asyncio.Future[None] | None = None
        self._rate_limited = False  # whether this server holds the log's rate limit

    # -- facts ------------------------------------------------------------------------------

    @property
    def models(self) -> Mapping[str, ServedModel]:
        return MappingProxyType(self._models)

    @property
    def http_port(self) -> int | None:
        return None if self._http is None else int(self._http.port)

    @property
    def grpc_port(self) -> int | None:
        return None if self._grpc is None else int(self._grpc.port)

    @property
    def max_request_bytes(self) -> int:
        """The largest request body (HTTP) or message (gRPC) taken: the served models'
        largest inputs as JSON (:func:`~._kserve.request_limit`); known once started."""
        return request_limit([list(m.inputs.values()) for m in self._models.values()])

    @property
    def body_timeout(self) -> float:
        """Seconds a MiB an HTTP request body may take to arrive (at least a MiB's worth)."""
        return self._body_timeout

    @property
    def header_timeout(self) -> float:
        """Seconds an HTTP request's headers (and a TLS handshake) may take to arrive."""
        return self._header_timeout

    @property
    def max_connections(self) -> int:
        """HTTP connections open at once, at most (and at most half the open-file limit)."""
        return self._max_connections

    @property
    def tls(self) -> bool:
        """Whether both fronts serve over TLS only."""
        return self._tls is not None

    @property
    def accepting(self) -> bool:
        return self._accepting

    def ready(self) -> bool:
        """Ready: accepting requests, and every model's engine serves."""
        return self._accepting and all(m.ready for m in self._models.values())

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    def statistics(self) -> ServeStatistics:
        return ServeStatistics(
            self._received, self._succeeded, MappingProxyType(dict(self._failed)), self._in_flight
        )

    def model(self, name: str, version: str = "") -> ServedModel:
        """The model of that name (version "" or "1"), or NOT_FOUND as Triton says it."""
        model = self._models.get(name)
        if model is None or version not in ("", VERSION):
            which = f"'{name}'" if not version else f"'{name}' version {version}"
            raise ProtocolError(
                Status.NOT_FOUND, f"Request for unknown model: {which} is not found"
            )
        return model

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Read every engine's tensors and start listening (the engines must be open)."""
        self._models = {name: ServedModel(name, e) for name, e in self._engines.items()}
        if not self._rate_limited:
            self._rate_limited = True
            rate_limited.add()
        try:
            if self._http_address is not None:
                self._http = HttpFront(self)
                await self._http.start(*self._http_address, self._tls)
            if self._grpc_address is not None:
                self._grpc = GrpcFront(self)
                await self._grpc.start(*self._grpc_address, self._tls)
        except BaseException:
            await self._close_fronts(0.0)
            raise
        self._accepting = True
        exposed = [
            f"{what} on {host}:{port}"
            for what, address, port in (
                ("HTTP", self._http_address, self.http_port),
                ("gRPC", self._grpc_address, self.grpc_port),
            )
            if address is not None and not _loopback(host := address[0])
        ]
        if exposed and self._tls is None:
            logger.warning(
                "%s, in cleartext and with no authentication: anyone who "
                "reaches it may infer (see the README on TLS and putting a proxy in front)",
                " and ".join(exposed),
            )

    async def stop(self) -> None:
        """Stop accepting, answer what was accepted (within ``drain_timeout``), close
        the fronts. Idempotent.

        Cancellation: stopping runs in its own task; cancelling ``stop`` stops the wait.
        """
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        self._accepting = False
        # Listening sockets close first, so a client's next connection fails over at
        # once rather than after the drain.
        if self._http is not None:
            await self._http.stop_listening()
        if self._grpc is not None:
            self._grpc.stop_accepting(self._drain_timeout + 1.0)
        if self._in_flight:
            logger.info("draining %d request(s)", self._in_flight)
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), self._drain_timeout)
            except asyncio.TimeoutError:
                self._force_answers()
        await self._close_fronts(1.0)

    def _force_answers(self) -> None:
        """The drain is over: requests still running are answered UNAVAILABLE."""
        logger.warning(
            "%d request(s) still running after the drain timeout of %g s; "
            "they are answered UNAVAILABLE",
            self._in_flight,
            self._drain_timeout,
        )
        for future in list(self._futures):
            self._forced.add(future)
            future.cancel()
        if self._http is not None:
            self._http.stop_reading()

    async def _close_fronts(self, grace: float) -> None:
        if self._in_flight:
            # Answers of forced requests are on their way out; let the handlers write them.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        if self._http is not None:
            await self._http.close()
        if self._grpc is not None:
            await self._grpc.close()
        if self._rate_limited:
            self._rate_limited = False
            rate_limited.remove()

    # -- requests ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count one inference request from arrival to answer (success or status)."""
        if not self._accepting:
            self._received += 1
            self._count(Status.UNAVAILABLE.grpc)
            raise ProtocolError(Status.UNAVAILABLE, "the server is shutting down")
        self._received += 1
        self._in_flight += 1
        try:
            yield
        except asyncio.CancelledError:
            self._count("CANCELLED")
            raise
        except Exception as exc:
            self._count(error_of(exc).status.grpc)
            raise
        else:
            self._succeeded += 1
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    def _count(self, status: str) -> None:
        self._failed[status] = self._failed.get(status, 0) + 1

    async def infer(
        self,
        model: ServedModel,
        inputs: Mapping[str, _Array],
        outputs: Sequence[WireTensor],
        timeout: float | None,
    ) -> list[_Array]:
        """Run ``model`` on ``inputs``; return the ``outputs`` asked for, in that order.

        Every error is a :class:`ProtocolError` (bad input, full queue, deadline, dead
        engine: see :func:`~._kserve.error_of`).

        Cancellation: cancelling the call cancels the engine request (removed from
        the queue if it is still there).
        """
        missing = [name for name in model.inputs if name not in inputs]
        if missing:
            raise ProtocolError(
                Status.INVALID_ARGUMENT,
                f"expected {len(model.inputs)} inputs but got {len(inputs)} inputs for "
                f"model {model.name!r}; missing {missing}",
            )
        if timeout is not None and timeout <= 0:
            raise ProtocolError(Status.DEADLINE_EXCEEDED, "the request's deadline had passed")
        try:
            future = model.engine.infer_nowait(dict(inputs), timeout=timeout)
        except Exception as exc:
            raise error_of(exc) from exc
        self._futures.add(future)
        try:
            result = await future
        except asyncio.CancelledError:
            if future in self._forced:
                raise ProtocolError(
                    Status.UNAVAILABLE,
                    "the server shut down before the request finished (drain timeout)",
                ) from None
            raise
        except Exception as exc:
            raise error_of(exc) from exc
        finally:
            self._futures.discard(future)
            self._forced.discard(future)
        answer = model.answer(result)
        return [answer[tensor.name] for tensor in outputs]


def _the_only_one(given: dict[str, Any], named: Mapping[str, str], option: str) -> dict[str, Any]:
    """Settings given for the model ``""`` belong to the only model served."""
    if "" not in given:
        return given
    if len(named) != 1:
        raise ConfigurationError(
            f"--{option} must name its model when several are served ({sorted(named)})"
        )
    (only,) = named
    if only in given:
        raise ConfigurationError(f"--{option} given twice for model {only!r}")
    return {only: given.pop("")} | given


async def serve(
    models: Sequence[str],
    *,
    http: str | None = "127.0.0.1:8000",
    grpc: str | None = "127.0.0.1:8001",
    runtime: str | Runtime = "auto",
    drain_timeout: float = 30.0,
    body_timeout: float = BODY_TIMEOUT,
    header_timeout: float = HEADER_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    started: Any = None,
    priorities: Mapping[str, int] | None = None,
    weights: Mapping[str, float] | None = None,
    preprocess: Mapping[str, Mapping[str, ImagePreprocess]] | None = None,
    postprocess: Mapping[str, Detect] | None = None,
    **options: Any,
) -> ServeStatistics:
    """Open an engine per model (``PATH`` or ``NAME=PATH``), serve them until SIGTERM
    or SIGINT, then drain, stop and close; return the server's statistics.

    ``runtime`` and ``options`` go to every :class:`~aiodla.Engine` (a runtime's name
    or instance; ``cores``, ``max_queue``, ...), the rest to :class:`Server`.
    Several models share their cores (one :class:`~aiodla.Cores`), each with its
    ``priorities[name]`` (default 0) and ``weights[name]`` (default 1).
    ``preprocess[name]`` (input name -> :class:`~aiodla.ImagePreprocess`) and
    ``postprocess[name]`` (a :class:`~aiodla.Detect`) make that model a detector served
    as one: camera frames in, detections out; the name ``""`` means the only model.
    ``started(server)`` is called once the server listens.
    """
    for address, what in ((http, "HTTP"), (grpc, "gRPC")):
        front_address(address, what)  # a typo fails before any engine opens
    Tls.load(tls_cert, tls_key, tls_client_ca)  # and so does a TLS file
    named: dict[str, str] = {}
    for text in models:
        name, path = parse_model(text)
        if name in named:
            raise ConfigurationError(f"two models named {name!r}; name one NAME=PATH")
        named[name] = os.fspath(path)
    shares: dict[str, dict[str, Any]] = {
        "priority": dict(priorities or {}),
        "weight": dict(weights or {}),
        "preprocess": _the_only_one(dict(preprocess or {}), named, "preprocess"),
        "postprocess": _the_only_one(dict(postprocess or {}), named, "detect"),
    }
    for what, given in shares.items():
        unknown = sorted(set(given) - set(named))
        if unknown:
            option = "detect" if what == "postprocess" else what
            raise ConfigurationError(f"--{option} names {unknown}; the models are {sorted(named)}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        where: dict[str, Any] = {"runtime": runtime}
        if len(named) > 1:  # one feed per core decides across the models
            trust = options.pop("trust_compute", False)
            shared = Cores(options.pop("cores", (0, 1)), runtime=runtime, trust_compute=trust)
            where = {"cores": await stack.enter_async_context(shared)}
        engines = {}
        for name, path in named.items():
            mine = {what: given[name] for what, given in shares.items() if name in given}
            engines[name] = await stack.enter_async_context(
                Engine(path, **where, **mine, **options)
            )
        server = Server(
            engines,
            http=http,
            grpc=grpc,
            drain_timeout=drain_timeout,
            body_timeout=body_timeout,
            header_timeout=header_timeout,
            max_connections=max_connections,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_client_ca=tls_client_ca,
        )
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        stack.callback(loop.remove_signal_handler, signal.SIGINT)
        stack.callback(loop.remove_signal_handler, signal.SIGTERM)
        await server.start()
        try:
            if started is not None:
                started(server)
            await stop.wait()
            logger.info("stopping")
        finally:
            await server.stop()
        return server.statistics()
    raise AssertionError("unreachable")  # pragma: no cover  (mypy: the stack may swallow)
