"""The gRPC front of the KServe v2 protocol: ``inference.GRPCInferenceService`` on
grpcio's asyncio server (``grpc.aio``), on the event loop that runs the engines.

It answers ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and
ModelInfer; the service's other calls (ModelConfig, statistics, streaming, repository,
shared memory, ...) get UNIMPLEMENTED from grpcio itself. A message larger than the
served models take (:func:`~._kserve.request_limit`) is refused RESOURCE_EXHAUSTED.
Connections are capped as the HTTP front's are, and a connection's handshake (TLS,
then HTTP/2's preface) has ``header_timeout``, through grpcio's channel options.
Inputs come as ``raw_input_contents`` (every input, or none) or in typed
``contents``; outputs always go out as ``raw_output_contents``, as Triton answers. A
request's deadline is the sooner of the call's gRPC deadline and its ``timeout``
parameter (microseconds, as tritonclient sends it).

The handlers are registered by method name on a generic handler rather than through
a generated ``_pb2_grpc`` module: that module pins the grpcio version it was generated
with, and the messages module is all the protocol needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc  # type: ignore[import-untyped,unused-ignore]
import numpy as np
from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]
from grpc import aio  # type: ignore[import-untyped,unused-ignore]

from ._connections import connection_cap
from ._kserve import ProtocolError, Status, decode_json, decode_raw, error_of, raw_bytes
from ._pb import grpc_service_pb2 as pb
from ._served import Backend, ServedModel
from ._tls import Tls

__all__ = ["SERVICE", "GrpcFront"]

SERVICE = "inference.GRPCInferenceService"
_Array = np.ndarray[Any, Any]


# Which InferTensorContents field carries a datatype's values (FP16 has none: raw only).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


class GrpcFront:
    """The grpc.aio server for one :class:`~._served.Backend`."""

    def __init__(self, server: Backend) -> None:
        self._server = server
        # Triton's clients send a whole frame in one message: the limit is what the
        # served models take (grpcio refuses a larger message, RESOURCE_EXHAUSTED, from
        # its length prefix); answers are as large as the outputs.
        self.limit = server.max_request_bytes
        options = [
            ("grpc.max_receive_message_length", self.limit),
            ("grpc.max_send_message_length", -1),
            # The HTTP front's limits: connections open at once, and the time a
            # connection's handshake (TLS, then HTTP/2's) may take.
            ("grpc.max_allowed_incoming_connections", connection_cap(server.max_connections)),
            ("grpc.server_handshake_timeout_ms", int(server.header_timeout * 1000)),
        ]
        self._grpc = aio.server(options=options)
        calls: dict[str, tuple[Callable[..., Any], Any, Any]] = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
            "ServerMetadata": (
                self.server_metadata,
                pb.ServerMetadataRequest,
                pb.ServerMetadataResponse,
            ),
            "ModelMetadata": (
                self.model_metadata,
                pb.ModelMetadataRequest,
                pb.ModelMetadataResponse,
            ),
            # Its message is parsed by the handler, so a malformed one is a request the
            # server counts and answers INVALID_ARGUMENT (grpcio's own answer is UNKNOWN).
            "ModelInfer": (self.model_infer, None, pb.ModelInferResponse),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                call,
                request_deserializer=None if request is None else request.FromString,
                response_serializer=response.SerializeToString,
            )
            for name, (call, request, response) in calls.items()
        }
        self._grpc.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        self._stopping: Any = None
        self.port = 0

    async def start(self, host: str, port: int, tls: Tls | None) -> None:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if tls is None:
            self.port = self._grpc.add_insecure_port(where)
        else:
            credentials = grpc.ssl_server_credentials(
                [(tls.key, tls.cert)],
                root_certificates=tls.client_ca,
                require_client_auth=tls.client_ca is not None,
            )
            self.port = self._grpc.add_secure_port(where, credentials)
        if not self.port:
            raise OSError(f"gRPC: cannot listen on {where}")
        await self._grpc.start()

    def stop_accepting(self, grace: float) -> None:
        """Refuse new calls now; calls running get ``grace`` seconds, then are cancelled."""
        import asyncio

        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._grpc.stop(grace))

    async def close(self) -> None:
        self.stop_accepting(0.0)
        await self._stopping

    # -- health and metadata ---------------------------------------------------------------

    async def server_live(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        return pb.ServerReadyResponse(ready=self._server.ready())

    async def _model(
        self, name: str, version: str, context: aio.ServicerContext[Any, Any]
    ) -> ServedModel:
        try:
            return self._server.model(name, version)
        except ProtocolError as exc:
            await _abort(context, exc)
            raise  # unreachable: abort raises

    async def model_ready(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        model = await self._model(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=model.ready and self._server.accepting)

    async def server_metadata(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        return pb.ServerMetadataResponse(**self._server.server_metadata())

    async def model_metadata(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        model = await self._model(request.name, request.version, context)
        meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=model.name,
            versions=["1"],
            platform="aiodla",
            inputs=[
                meta(name=t.name, datatype=t.datatype, shape=t.shape) for t in model.inputs.values()
            ],
            outputs=[
                meta(name=t.name, datatype=t.datatype, shape=t.shape)
                for t in model.outputs.values()
            ],
        )

    # -- inference -----------------------------------------------------------------------------

    async def model_infer(self, message: bytes, context: aio.ServicerContext[Any, Any]) -> Any:
        try:
            with self._server.request():
                request = _parsed(message)
                model = self._server.model(request.model_name, request.model_version)
                inputs = _inputs(model, request)
                outputs = model.output_tensors([o.name for o in request.outputs])
                for asked in request.outputs:
                    if "classification" in asked.parameters:
                        raise ProtocolError(
                            Status.INVALID_ARGUMENT,
                            "the classification extension is not supported",
                        )
                timeout = _timeout(request, context.time_remaining())
                values = await self._server.infer(model, inputs, outputs, timeout)
                response = pb.ModelInferResponse(
                    model_name=model.name, model_version="1", id=request.id
                )
                for tensor, value in zip(outputs, values, strict=True):
                    response.outputs.add(
                        name=tensor.name, datatype=tensor.datatype, shape=value.shape
                    )
                    response.raw_output_contents.append(raw_bytes(value))
                return response
        except Exception as exc:
            await _abort(context, error_of(exc))


def _parsed(message: bytes) -> Any:
    try:
        return pb.ModelInferRequest.FromString(message)
    except DecodeError as exc:
        raise ProtocolError(
            Status.INVALID_ARGUMENT, f"the ModelInferRequest message cannot be parsed: {exc}"
        ) from None


async def _abort(context: aio.ServicerContext[Any, Any], error: ProtocolError) -> None:
    await context.abort(getattr(grpc.StatusCode, error.status.grpc), error.message)


def _inputs(model: ServedModel, request: Any) -> dict[str, _Array]:
    raw: Sequence[bytes] = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(
            Status.INVALID_ARGUMENT,
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "give every input's values there, or none",
        )
    arrays: dict[str, _Array] = {}
    for index, tensor in enumerate(request.inputs):
        wire = model.input_tensor(tensor.name)
        if wire.name in arrays:
            raise ProtocolError(Status.INVALID_ARGUMENT, f"input {wire.name!r} given twice")
        shape = list(tensor.shape)
        if raw:
            arrays[wire.name] = decode_raw(wire, tensor.datatype, shape, raw[index])
            continue
        field = _CONTENTS.get(tensor.datatype)
        if field is None:
            raise ProtocolError(
                Status.INVALID_ARGUMENT,
                f"input {wire.name!r}: {tensor.datatype or 'no datatype'} values must come "
                "in raw_input_contents",
            )
        values = list(getattr(tensor.contents, field))
        arrays[wire.name] = decode_json(wire, tensor.datatype, shape, values)
    return arrays


def _timeout(request: Any, remaining: float | None) -> float | None:
    """The sooner of the gRPC deadline and Triton's ``timeout`` parameter (µs, 0: none)."""
    timeout = remaining
    if "timeout" in request.parameters:
        value = request.parameters["timeout"]
        if value.WhichOneof("parameter_choice") != "int64_param" or value.int64_param < 0:
            raise ProtocolError(
                Status.INVALID_ARGUMENT, "parameter 'timeout' must be int64 microseconds >= 0"
            )
        if value.int64_param:
            seconds = value.int64_param / 1e6
            timeout = seconds if timeout is None else min(timeout, seconds)
    return timeout
