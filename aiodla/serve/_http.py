"""The HTTP/REST front of the KServe v2 protocol, as Triton serves it, on aiohttp.

Routes: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2`` (server metadata),
``/v2/models/{name}[/versions/{v}]`` (model metadata) and ``.../ready``,
``POST .../infer`` (JSON tensors, and the binary tensor data extension: the JSON
header's length in ``Inference-Header-Content-Length``, then each binary input's
``binary_data_size`` bytes in input order; outputs asked for with
``binary_data_output`` or an output's ``binary_data`` come back the same way), and
``GET /metrics`` (Prometheus, Triton's families and aiodla's own). Errors are
``{"error": message}`` with the protocol's status code.

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

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from ._kserve import ProtocolError, Status, decode_json, decode_raw, error_of, raw_bytes

if TYPE_CHECKING:
    from ._app import ServedModel, Server

__all__ = ["MAX_REQUEST_BYTES", "HttpFront"]

#: The largest request body taken (aiohttp's default of 1 MiB is smaller than one
#: float32 1x3x640x640 frame).
MAX_REQUEST_BYTES = 256 * 1024 * 1024
HEADER_LENGTH = "Inference-Header-Content-Length"
_Array = np.ndarray[Any, Any]
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(error: ProtocolError) -> web.Response:
    return web.json_response({"error": error.message}, status=error.status.http)


def _bad(message: str) -> ProtocolError:
    return ProtocolError(Status.INVALID_ARGUMENT, message)


class HttpFront:
    """The aiohttp application and its runner, for one :class:`Server`."""

    def __init__(self, server: Server) -> None:
        from prometheus_client import CollectorRegistry

        from ..metrics import EngineCollector

        self._server = server
        self._registry = CollectorRegistry(auto_describe=False)
        engines = {name: model.engine for name, model in server.models.items()}
        # Triton's families for dashboards written for Triton, aiodla's for the rest
        # (per-core figures, health); their names do not overlap.
        self._registry.register(EngineCollector(engines, naming="triton"))
        self._registry.register(EngineCollector(engines, naming="aiodla"))
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        get, post = app.router.add_get, app.router.add_post
        get("/v2/health/live", self.live)
        get("/v2/health/ready", self.ready)
        get("/v2", self.server_metadata)
        get("/metrics", self.metrics)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            get(base, self.model_metadata)
            get(base + "/ready", self.model_ready)
            post(base + "/infer", self.infer)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        self._site: web.TCPSite | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port)
        await self._site.start()
        self.port = self._runner.addresses[0][1]

    async def stop_listening(self) -> None:
        if self._site is not None:
            await self._site.stop()
            self._site = None

    async def close(self) -> None:
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
                body = await request.read()
                header, binary = _split(body, request.headers.get(HEADER_LENGTH))
                inputs = _inputs(model, header, binary)
                parameters = _mapping(header.get("parameters", {}), "parameters")
                outputs, as_binary = _outputs(model, header, parameters)
                values = await self._server.infer(
                    model, inputs, [spec for spec, _ in outputs], _timeout(parameters)
                )
                return _response(model, header, outputs, as_binary, values)
        except Exception as exc:
            return _error(error_of(exc))


def _split(body: bytes, length: str | None) -> tuple[dict[str, Any], memoryview]:
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
        header = json.loads(bytes(memoryview(body)[:cut]))
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
        spec = model.input_spec(tensor.get("name"))
        if spec.name in arrays:
            raise _bad(f"input {spec.name!r} given twice")
        datatype, shape = tensor.get("datatype"), tensor.get("shape")
        size = _mapping(tensor.get("parameters", {}), "parameters").get("binary_data_size")
        if size is None:
            if "data" not in tensor:
                raise _bad(f"input {spec.name!r} has neither 'data' nor 'binary_data_size'")
            arrays[spec.name] = decode_json(spec, datatype, shape, tensor["data"])
            continue
        if type(size) is not int or size < 0 or offset + size > len(binary):
            raise _bad(
                f"input {spec.name!r}: binary_data_size {size!r} runs past the "
                f"{len(binary)} bytes of binary data"
            )
        arrays[spec.name] = decode_raw(spec, datatype, shape, binary[offset : offset + size])
        offset += size
    if offset != len(binary):
        raise _bad(
            f"the request has {len(binary)} bytes of binary data but its inputs take {offset}"
        )
    return arrays


def _outputs(
    model: ServedModel, header: Mapping[str, Any], parameters: Mapping[str, Any]
) -> tuple[list[tuple[Any, bool]], bool]:
    """The outputs asked for, each with whether it goes out binary; and whether any does."""
    default = parameters.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise _bad("parameter 'binary_data_output' must be true or false")
    asked = header.get("outputs")
    if asked is None:
        return [(spec, default) for spec in model.output_specs(None)], default
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
    specs = model.output_specs([str(n) for n in names])
    return list(zip(specs, flags, strict=True)), any(flags)


def _timeout(parameters: Mapping[str, Any]) -> float | None:
    """Triton's request parameter ``timeout``: microseconds, 0 for none."""
    value = parameters.get("timeout")
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise _bad(f"parameter 'timeout' must be whole microseconds >= 0, got {value!r}")
    return value / 1e6 if value else None


def _response(
    model: ServedModel,
    header: Mapping[str, Any],
    outputs: list[tuple[Any, bool]],
    as_binary: bool,
    values: list[_Array],
) -> web.Response:
    answer: dict[str, Any] = {"model_name": model.name, "model_version": "1"}
    if "id" in header:
        answer["id"] = header["id"]
    tensors = []
    chunks = []
    for (spec, binary), value in zip(outputs, values, strict=True):
        tensor: dict[str, Any] = {
            "name": spec.name,
            "datatype": _datatype(model, spec.name),
            "shape": list(value.shape),
        }
        if binary:
            data = raw_bytes(value)
            tensor["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            tensor["data"] = _json_values(value)
        tensors.append(tensor)
    answer["outputs"] = tensors
    text = json.dumps(answer, separators=(",", ":")).encode()
    if not as_binary:
        return web.Response(body=text, content_type="application/json")
    return web.Response(
        body=b"".join([text, *chunks]),
        content_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(text))},
    )


def _datatype(model: ServedModel, name: str) -> str:
    return next(t.datatype for t in model.output_metadata if t.name == name)


def _json_values(value: _Array) -> list[Any]:
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        # JSON has no NaN or infinity; Triton refuses them too and points to binary.
        raise ProtocolError(
            Status.INTERNAL,
            "an output holds NaN or infinity, which JSON cannot carry; ask for it as "
            "binary data (binary_data_output)",
        )
    values: list[Any] = value.ravel().tolist()
    return values
