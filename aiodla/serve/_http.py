"""The HTTP/REST front of the KServe v2 protocol, as Triton serves it, on aiohttp.

Routes: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2`` (server metadata),
``/v2/models/{name}[/versions/{v}]`` (model metadata) and ``.../ready``,
``POST .../infer`` (JSON tensors, and the binary tensor data extension: the JSON
header's length in ``Inference-Header-Content-Length``, then each binary input's
``binary_data_size`` bytes in input order; outputs asked for with
``binary_data_output`` or an output's ``binary_data`` come back the same way), and
``GET /metrics`` (Prometheus, Triton's families and aiodla's own). Every error,
a route not served and a request aiohttp's parser refuses included, is ``{"error":
message}`` with its status code, which is what tritonclient reads. The connections
themselves (how many, how long a request's headers and a TLS handshake may take) are
:mod:`._connections`'s.

Memory: a request body may be at most :func:`~._kserve.request_limit` bytes (the served
models' largest inputs as JSON), refused with 413 from its ``Content-Length`` before any
of it is read; and the bodies held at once share a byte budget
(:class:`~._budget.ByteBudget`), taken as the bytes arrive. A body must arrive within
``body_timeout`` seconds a MiB (at least one MiB's worth, time spent waiting on the
client only), else it is answered 408 and the connection closed: a stalled upload
holds what it sent for that long, and no one waits on it. Large JSON is parsed and
written in a worker thread, in pieces (:mod:`._json`), so it does not stall the loop.

Why aiohttp: the server must run on the event loop that owns the engines, so a
handler calls ``Engine.infer_nowait`` directly, with no thread hop or second loop, and
shut down together with the gRPC front under one drain. aiohttp (aio-libs, maintained
since 2014, releases for every CPython) is a plain asyncio server that runs on a loop
it is given, hands handlers the raw body bytes and headers that the binary extension
needs, and has graceful shutdown built in (``AppRunner.cleanup`` closes listeners,
then waits for running handlers). An ASGI stack (Starlette or FastAPI under uvicorn
or hypercorn) adds a layer per request and a server that wants to own the loop and
the signals; tornado would do, but aiohttp is also what ``tritonclient.http.aio`` is
built on, so clients and tests share one dependency.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
from aiohttp import web

from ._budget import Account, ByteBudget
from ._connections import KEEPALIVE_TIMEOUT, JsonErrorHandler, Listener
from ._json import NestingError, dumps_values, loads, nesting
from ._kserve import ProtocolError, Status, decode_json, decode_raw, error_of, raw_bytes
from ._served import Backend, ServedModel
from ._tls import Tls

__all__ = ["OFFLOAD_BYTES", "HttpFront", "budget_for"]

#: JSON larger than this (request header, or the values of JSON outputs, at about 16
#: bytes a value) is parsed or written in a worker thread.
OFFLOAD_BYTES = 64 * 1024
#: The least byte budget for request bodies held at once.
MIN_BUDGET_BYTES = 256 * 1024 * 1024
MIB = 1024 * 1024
HEADER_LENGTH = "Inference-Header-Content-Length"
logger = logging.getLogger("aiodla.serve")
_Array = np.ndarray[Any, Any]
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(error: ProtocolError) -> web.Response:
    return web.json_response({"error": error.message}, status=error.status.http)


def budget_for(limit: int) -> int:
    """The byte budget for request bodies held at once: four of the largest."""
    return max(MIN_BUDGET_BYTES, 4 * limit)


@web.middleware
async def _json_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Every error as ``{"error": message}``: aiohttp's own (a route not served, a
    method not allowed) and an unexpected exception's 500 come as plain text, which
    tritonclient cannot read."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(exc, request)
    except Exception as exc:
        logger.exception("%s %s failed", request.method, request.path)
        return _error(error_of(exc))


def _http_error(exc: web.HTTPException, request: web.Request) -> web.Response:
    """aiohttp's error as JSON, with its status and headers (``Allow`` for a 405)."""
    headers = {
        k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")
    }
    if exc.status in (404, 405):
        message = f"{exc.reason}: {request.method} {request.path} is not served"
    elif exc.text and exc.text != f"{exc.status}: {exc.reason}":
        message = exc.text
    else:
        message = exc.reason
    return web.json_response({"error": message}, status=exc.status, headers=headers)


def _bad(message: str) -> ProtocolError:
    return ProtocolError(Status.INVALID_ARGUMENT, message)


class HttpFront:
    """The aiohttp application and its runner, for one :class:`~._served.Backend`."""

    def __init__(self, server: Backend) -> None:
        from prometheus_client import CollectorRegistry

        from ..metrics import EngineCollector

        self._server = server
        self._registry = CollectorRegistry(auto_describe=False)
        engines = {name: model.engine for name, model in server.models.items()}
        # Triton's families for dashboards written for Triton, aiodla's for the rest
        # (per-core figures, health); their names do not overlap.
        self._registry.register(EngineCollector(engines, naming="triton"))
        self._registry.register(EngineCollector(engines, naming="aiodla"))
        self.limit = server.max_request_bytes
        self.budget = ByteBudget(budget_for(self.limit))
        app = web.Application(
            client_max_size=self.limit, middlewares=[self._headers_arrived, _json_errors]
        )
        get, post = app.router.add_get, app.router.add_post
        get("/v2/health/live", self.live)
        get("/v2/health/ready", self.ready)
        get("/v2", self.server_metadata)
        get("/metrics", self.metrics)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            get(base, self.model_metadata)
            get(base + "/ready", self.model_ready)
            get(base + "/config", self.model_config)
            post(base + "/infer", self.infer)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        self._listener: Listener | None = None
        self.port = 0
        # The handlers reading a body, and those told to stop (see stop_reading).
        self._reading: set[asyncio.Task[Any]] = set()
        self._stopped: set[asyncio.Task[Any]] = set()

    async def start(self, host: str, port: int, tls: Tls | None) -> None:
        await self._runner.setup()
        manager, loop = self._runner.server, asyncio.get_running_loop()
        assert manager is not None  # (set up above)

        # No access log (aiohttp takes None for it, as AppRunner(access_log=None) does).
        options: dict[str, Any] = {"access_log": None, "keepalive_timeout": KEEPALIVE_TIMEOUT}

        def handler() -> web.RequestHandler:
            return JsonErrorHandler(manager, loop=loop, **options)

        listener = Listener(
            handler,
            tls=None if tls is None else tls.ssl_context(),
            max_connections=self._server.max_connections,
            header_timeout=self._server.header_timeout,
        )
        await listener.start(host, port)
        self._listener = listener  # only once it listens: one that never started cannot stop
        self.port = listener.port

    @property
    def listener(self) -> Listener | None:
        """The listening socket and its connections, once started."""
        return self._listener

    @web.middleware
    async def _headers_arrived(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """A request's headers came: their timeout is over until the next request."""
        listener = self._listener
        if listener is None:
            return await handler(request)
        listener.request_started(request.transport)
        try:
            return await handler(request)
        finally:
            listener.request_finished(request.transport)

    async def stop_listening(self) -> None:
        if self._listener is not None:
            self._listener.stop_listening()

    def stop_reading(self) -> None:
        """The drain is over: bodies still arriving are answered UNAVAILABLE."""
        for task in list(self._reading):
            self._stopped.add(task)
            task.cancel()

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.stop_listening()
            self._listener.abort_unserved()
        await self._runner.cleanup()

    # -- health and metadata ---------------------------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        return web.Response()

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._server.ready() else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self._server.server_metadata())

    def _model(self, request: web.Request) -> ServedModel:
        info = request.match_info
        return self._server.model(info["model"], info.get("version", ""))

    async def model_metadata(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(self._model(request).metadata())
        except ProtocolError as exc:
            return _error(exc)

    async def model_config(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(self._model(request).config())
        except ProtocolError as exc:
            return _error(exc)

    async def model_ready(self, request: web.Request) -> web.Response:
        try:
            ready = self._model(request).ready and self._server.accepting
        except ProtocolError as exc:
            return _error(exc)
        return web.Response(status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(
            body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    # -- inference -----------------------------------------------------------------------------

    async def infer(self, request: web.Request) -> web.Response:
        try:
            with self._server.request():
                model = self._model(request)
                size = request.content_length
                if size is not None and size > self.limit:
                    raise _too_large(size, self.limit)
                # A body of unknown length (chunked) may take up to the limit.
                async with self.budget.account(self.limit if size is None else size) as account:
                    body = await self._read(request, account)
                    return await self._infer(model, request, body)
        except web.HTTPException as exc:
            response = _http_error(exc, request)
        except Exception as exc:
            response = _error(error_of(exc))
        if not request.content.is_eof():
            response.force_close()  # the rest of the body is never read
        return response

    async def _read(self, request: web.Request, account: Account) -> bytearray:
        """The request's body, taken from the budget as it arrives, within the body
        timeout; a client that goes away is a cancelled request.

        Cancellation: by :meth:`stop_reading`, an UNAVAILABLE answer; else as usual.
        """
        task = asyncio.current_task()
        assert task is not None
        self._reading.add(task)
        try:
            return await self._receive(request, account)
        except asyncio.CancelledError:
            if task not in self._stopped:
                raise
            if sys.version_info >= (3, 11):
                task.uncancel()
            raise ProtocolError(
                Status.UNAVAILABLE,
                "the server shut down before the request body arrived (drain timeout)",
            ) from None
        finally:
            self._reading.discard(task)
            self._stopped.discard(task)

    async def _receive(self, request: web.Request, account: Account) -> bytearray:
        size = request.content_length
        allowed = self._server.body_timeout * max(1.0, (size or self.limit) / MIB)
        body = bytearray()
        loop = asyncio.get_running_loop()
        waited = 0.0
        while True:
            start = loop.time()
            try:
                if request.content.is_eof():  # all of it came: reading cannot wait
                    chunk = await request.content.readany()
                else:
                    chunk = await asyncio.wait_for(request.content.readany(), allowed - waited)
            except asyncio.TimeoutError:
                what = "the request body" if size is None else f"the request body of {size} bytes"
                raise ProtocolError(
                    Status.REQUEST_TIMEOUT,
                    f"{what} did not arrive within {allowed:g} s ({len(body)} bytes came; "
                    f"body_timeout is {self._server.body_timeout:g} s a MiB)",
                ) from None
            except ConnectionError:
                raise ProtocolError(
                    Status.CANCELLED, "the client went away before its request body arrived"
                ) from None
            except web.RequestPayloadError as exc:  # a Content-Encoding that does not decode
                message = " ".join(str(exc).split())
                raise _bad(f"the request body cannot be read: {message}") from None
            waited += loop.time() - start
            if not chunk:
                return body
            if len(body) + len(chunk) > self.limit:
                raise _too_large(None, self.limit)
            await account.take(len(chunk))
            body += chunk

    async def _infer(
        self, model: ServedModel, request: web.Request, body: bytearray
    ) -> web.Response:
        length = request.headers.get(HEADER_LENGTH)
        if _json_length(body, length) > OFFLOAD_BYTES:
            parsed = await asyncio.to_thread(_parse, model, body, length, _loads_large)
        else:
            parsed = _parse(model, body, length, _loads_small)
        header, inputs, outputs, as_binary, timeout = parsed
        values = await self._server.infer(model, inputs, [t for t, _ in outputs], timeout)
        in_json = sum(v.size for (_, binary), v in zip(outputs, values, strict=True) if not binary)
        if in_json * 16 > OFFLOAD_BYTES:
            text, chunks = await asyncio.to_thread(_answer, model, header, outputs, values)
        else:
            text, chunks = _answer(model, header, outputs, values)
        if not as_binary:
            return web.Response(body=text, content_type="application/json")
        return web.Response(
            body=b"".join([text, *chunks]),
            content_type="application/octet-stream",
            headers={HEADER_LENGTH: str(len(text))},
        )


def _too_large(size: int | None, limit: int) -> ProtocolError:
    what = "the request body" if size is None else f"a request body of {size} bytes"
    return ProtocolError(
        Status.RESOURCE_EXHAUSTED,
        f"{what} is larger than the {limit} bytes the served models' inputs take",
    )


#: Levels of arrays and objects around an input's values: the request object, its
#: "inputs" list and the tensor's object.
ENVELOPE_DEPTH = 3


def max_depth(model: ServedModel) -> int:
    """How deep a request for ``model`` may nest: its values nest once per dimension."""
    return ENVELOPE_DEPTH + max((len(s.shape) for s in model.inputs.values()), default=0)


def _loads_small(text: bytes, limit: int) -> Any:
    # The C parser, measured first: it has no depth limit but Python's recursion limit.
    if nesting(text) > limit:
        raise NestingError(limit)
    return json.loads(text)


def _loads_large(text: bytes, limit: int) -> Any:
    return loads(text, limit)


_Parsed = tuple[Mapping[str, Any], dict[str, _Array], list[tuple[Any, bool]], bool, float | None]


def _json_length(body: bytes | bytearray, length: str | None) -> int:
    try:
        return min(len(body), int(length)) if length is not None else len(body)
    except ValueError:
        return len(body)


def _parse(
    model: ServedModel,
    body: bytes | bytearray,
    length: str | None,
    loads: Callable[[bytes, int], Any],
) -> _Parsed:
    """The request's header, its inputs, the outputs asked for (each with whether it
    goes out binary), whether any does, and its timeout."""
    header, binary = _split(model, body, length, loads)
    inputs = _inputs(model, header, binary)
    parameters = _mapping(header.get("parameters", {}), "parameters")
    outputs, as_binary = _outputs(model, header, parameters)
    return header, inputs, outputs, as_binary, _timeout(parameters)


def _split(
    model: ServedModel,
    body: bytes | bytearray,
    length: str | None,
    loads: Callable[[bytes, int], Any],
) -> tuple[dict[str, Any], memoryview]:
    """The JSON header and the binary part of a request body."""
    if length is None:
        cut = len(body)
    else:
        try:
            cut = int(length)
        except ValueError:
            cut = -1
        if not 0 <= cut <= len(body):
            raise _bad(f"{HEADER_LENGTH}: {length!r} is not a length within the body")
    try:
        header = loads(bytes(memoryview(body)[:cut]), max_depth(model))
    except NestingError as exc:
        rank = exc.limit - ENVELOPE_DEPTH
        raise _bad(
            f"{exc}: an input's data nests once per dimension, at most {rank} for model "
            f"{model.name!r}, inside the request's object, its 'inputs' list and the "
            "input's object"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _bad("the request JSON must be an object")
    return header, memoryview(body)[cut:]


def _mapping(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _bad(f"{what!r} must be a JSON object")
    return value


def _inputs(model: ServedModel, header: Mapping[str, Any], binary: memoryview) -> dict[str, _Array]:
    tensors = header.get("inputs")
    if not isinstance(tensors, list):
        raise _bad("the request must have a list of 'inputs'")
    arrays: dict[str, _Array] = {}
    offset = 0
    for tensor in tensors:
        tensor = _mapping(tensor, "inputs[]")
        wire = model.input_tensor(tensor.get("name"))
        if wire.name in arrays:
            raise _bad(f"input {wire.name!r} given twice")
        datatype, shape = tensor.get("datatype"), tensor.get("shape")
        size = _mapping(tensor.get("parameters", {}), "parameters").get("binary_data_size")
        if size is None:
            if "data" not in tensor:
                raise _bad(f"input {wire.name!r} has neither 'data' nor 'binary_data_size'")
            array = decode_json(wire, datatype, shape, tensor["data"])
            if array.dtype.kind == "f" and array.size:
                _refuse_non_finite(wire.name, array)
            arrays[wire.name] = array
            continue
        if type(size) is not int or size < 0 or offset + size > len(binary):
            raise _bad(
                f"input {wire.name!r}: binary_data_size {size!r} runs past the "
                f"{len(binary)} bytes of binary data"
            )
        arrays[wire.name] = decode_raw(wire, datatype, shape, binary[offset : offset + size])
        offset += size
    if offset != len(binary):
        raise _bad(
            f"the request has {len(binary)} bytes of binary data but its inputs take {offset}"
        )
    return arrays


def _refuse_non_finite(name: str, array: _Array) -> None:
    # Python's parser takes NaN and Infinity, and 1e400 as infinity; JSON has none
    # of them (and Triton refuses them). min() and max() find one without a temporary.
    if not (np.isfinite(array.min()) and np.isfinite(array.max())):
        raise _bad(
            f"input {name!r}: NaN or infinity (NaN, Infinity or a number beyond float64's "
            "range) is not a JSON number; send such values as binary data"
        )


def _outputs(
    model: ServedModel, header: Mapping[str, Any], parameters: Mapping[str, Any]
) -> tuple[list[tuple[Any, bool]], bool]:
    """The outputs asked for, each with whether it goes out binary; and whether any does."""
    default = parameters.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise _bad("parameter 'binary_data_output' must be true or false")
    asked = header.get("outputs")
    if not asked:  # none, or an empty list: all of them
        return [(t, default) for t in model.output_tensors(None)], default
    if not isinstance(asked, list):
        raise _bad("'outputs' must be a list")
    names, flags = [], []
    for tensor in asked:
        tensor = _mapping(tensor, "outputs[]")
        options = _mapping(tensor.get("parameters", {}), "parameters")
        if "classification" in options:
            raise _bad("the classification extension is not supported")
        flag = options.get("binary_data", default)
        if not isinstance(flag, bool):
            raise _bad("output parameter 'binary_data' must be true or false")
        names.append(tensor.get("name"))
        flags.append(flag)
    wires = model.output_tensors([str(n) for n in names])
    return list(zip(wires, flags, strict=True)), any(flags)


def _timeout(parameters: Mapping[str, Any]) -> float | None:
    """Triton's request parameter ``timeout``: microseconds, 0 for none."""
    value = parameters.get("timeout")
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise _bad(f"parameter 'timeout' must be whole microseconds >= 0, got {value!r}")
    return value / 1e6 if value else None


def _answer(
    model: ServedModel,
    header: Mapping[str, Any],
    outputs: list[tuple[Any, bool]],
    values: list[_Array],
) -> tuple[bytes, list[bytes]]:
    """The response's JSON, and the binary outputs' bytes in order."""
    answer: dict[str, Any] = {"model_name": model.name, "model_version": "1"}
    if "id" in header:
        answer["id"] = header["id"]
    tensors = []
    chunks = []
    for (wire, binary), value in zip(outputs, values, strict=True):
        tensor: dict[str, Any] = {
            "name": wire.name,
            "datatype": wire.datatype,
            "shape": list(value.shape),
        }
        if binary:
            data = raw_bytes(value)
            tensor["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
            tensors.append(_dumps(tensor))
        else:
            # The values, written a chunk at a time, go in as the tensor's last key.
            text = _dumps(tensor)
            tensors.append(text[:-1] + ',"data":' + _json_values(value) + "}")
    answer["outputs"] = []
    text = _dumps(answer)
    # ... "outputs":[]} : the tensors go between the brackets.
    text = text[:-2] + ",".join(tensors) + "]}"
    return text.encode(), chunks


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _json_values(value: _Array) -> str:
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        # JSON has no NaN or infinity; Triton refuses them too and points to binary.
        raise ProtocolError(
            Status.INTERNAL,
            "an output holds NaN or infinity, which JSON cannot carry; ask for it as "
            "binary data (binary_data_output)",
        )
    return dumps_values(value)
