"""One interface over Triton's four Python clients (HTTP and gRPC, sync and asyncio),
so each protocol test runs through all of them. The sync clients block: they run in a
worker thread, never on the loop that serves them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
import tritonclient.http.aio as thttp_aio
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from aiodla.serve import Server

KINDS = ("http", "http_aio", "grpc", "grpc_aio")
Arrays = Mapping[str, np.ndarray[Any, Any]]


def _inputs(module: Any, arrays: Arrays, binary: bool, datatypes: Mapping[str, str]) -> list[Any]:
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(
            name, list(array.shape), datatypes.get(name) or np_to_triton_dtype(array.dtype)
        )
        if module is thttp:
            tensor.set_data_from_numpy(array, binary_data=binary)
        else:
            tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _outputs(module: Any, names: list[str] | None, binary: bool) -> list[Any] | None:
    if names is None:
        return None
    if module is thttp:
        return [module.InferRequestedOutput(n, binary_data=binary) for n in names]
    return [module.InferRequestedOutput(n) for n in names]


class Client:
    """``kind`` is one of KINDS; ``binary`` picks HTTP's binary extension or JSON
    (gRPC always sends raw bytes)."""

    def __init__(self, kind: str, server: Server) -> None:
        self.kind = kind
        self.http = kind.startswith("http")
        port = server.http_port if self.http else server.grpc_port
        self.url = f"127.0.0.1:{port}"

    def _sync(self) -> Any:
        if self.http:
            return thttp.InferenceServerClient(self.url)
        return tgrpc.InferenceServerClient(self.url)

    def _aio(self, **kwargs: Any) -> Any:
        if self.http:
            return thttp_aio.InferenceServerClient(self.url, **kwargs)
        return tgrpc_aio.InferenceServerClient(self.url)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.kind.endswith("_aio"):
            client = self._aio()
            try:
                return await getattr(client, method)(*args, **kwargs)
            finally:
                await client.close()

        def run() -> tuple[Any, BaseException | None]:
            # The HTTP client is gevent's: it must also be finalized on this thread (its
            # __del__ closes it again, which fails on another). So no reference may
            # outlive the call: not the local, not a traceback's frames.
            client = self._sync()
            try:
                return getattr(client, method)(*args, **kwargs), None
            except InferenceServerException as exc:
                return None, exc.with_traceback(None)
            finally:
                client.close()
                del client

        result, error = await asyncio.to_thread(run)
        if error is not None:
            raise error
        return result

    async def metadata(self, model: str) -> dict[str, Any]:
        """Model metadata as HTTP's JSON (gRPC's message turned into the same form)."""
        if self.http:
            return await self.call("get_model_metadata", model)  # type: ignore[no-any-return]
        answer = await self.call("get_model_metadata", model, as_json=True)
        for tensor in answer["inputs"] + answer["outputs"]:
            tensor["shape"] = [int(d) for d in tensor["shape"]]
        return answer  # type: ignore[no-any-return]

    async def infer(
        self,
        model: str,
        arrays: Arrays,
        *,
        binary: bool = True,
        outputs: list[str] | None = None,
        request_id: str = "",
        datatypes: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> tuple[dict[str, np.ndarray[Any, Any]], str]:
        """The outputs by name and the response's id."""
        module = thttp if self.http else tgrpc
        result = await self.call(
            "infer",
            model,
            _inputs(module, arrays, binary, datatypes or {}),
            outputs=_outputs(module, outputs, binary),
            request_id=request_id,
            **kwargs,
        )
        response = result.get_response()
        if self.http:
            names = [o["name"] for o in response["outputs"]]
            ident = response.get("id", "")
        else:
            names = [o.name for o in response.outputs]
            ident = response.id
        return {n: result.as_numpy(n) for n in names}, ident


async def failure(awaitable: Any) -> InferenceServerException:
    """The client's exception for a call that must fail."""
    try:
        await awaitable
    except InferenceServerException as exc:
        return exc
    raise AssertionError("the call succeeded")


async def until(condition: Callable[[], bool]) -> None:
    """Wait, a loop turn or so at a time, until ``condition()`` holds: a state the test
    reaches, never an amount of time (pytest's timeout bounds a wait that never ends)."""
    while not condition():
        await asyncio.sleep(0.002)
