"""What the HTTP and gRPC fronts see of the server: each served model
(:class:`ServedModel`) and the server's side of a request (:class:`Backend`, which
:class:`~._app.Server` implements). The fronts depend on this module, never on the
server's own, so the server can build its fronts without an import cycle."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .._engine import Engine
from .._tensors import TensorSpec
from ._kserve import ProtocolError, Status, tensor_metadata

__all__ = ["PLATFORM", "VERSION", "Backend", "ServedModel"]

PLATFORM = "aiodla"
VERSION = "1"

_Array = np.ndarray[Any, Any]


class ServedModel:
    """One model name, its engine, and the protocol's view of its tensors."""

    def __init__(self, name: str, engine: Engine) -> None:
        self.name = name
        self.engine = engine
        self.inputs: dict[str, TensorSpec] = {s.name: s for s in engine.inputs}
        self.outputs: dict[str, TensorSpec] = {s.name: s for s in engine.outputs}
        self.input_metadata = tuple(tensor_metadata(s, output=False) for s in engine.inputs)
        self.output_metadata = tuple(tensor_metadata(s, output=True) for s in engine.outputs)

    @property
    def ready(self) -> bool:
        return self.engine.health().status in ("ok", "degraded")

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [VERSION],
            "platform": PLATFORM,
            "inputs": [t.to_json() for t in self.input_metadata],
            "outputs": [t.to_json() for t in self.output_metadata],
        }

    def config(self) -> dict[str, Any]:
        """A Triton-style model configuration (what ``get_model_config`` reads): no
        batching dimension of Triton's, each tensor's full shape as its ``dims``."""

        def tensors(metadata: Sequence[Any]) -> list[dict[str, Any]]:
            return [
                {"name": t.name, "data_type": f"TYPE_{t.datatype}", "dims": list(t.shape)}
                for t in metadata
            ]

        return {
            "name": self.name,
            "platform": PLATFORM,
            "backend": PLATFORM,
            "max_batch_size": 0,
            "input": tensors(self.input_metadata),
            "output": tensors(self.output_metadata),
        }

    def input_spec(self, name: object) -> TensorSpec:
        spec = self.inputs.get(name) if isinstance(name, str) else None
        if spec is None:
            raise ProtocolError(
                Status.INVALID_ARGUMENT,
                f"unexpected inference input {name!r} for model {self.name!r}; it takes "
                f"{list(self.inputs)}",
            )
        return spec

    def output_specs(self, names: Sequence[str] | None) -> list[TensorSpec]:
        """The outputs to answer with: those named (in that order), or all of them."""
        if not names:
            return list(self.outputs.values())
        specs = []
        for name in names:
            spec = self.outputs.get(name)
            if spec is None:
                raise ProtocolError(
                    Status.INVALID_ARGUMENT,
                    f"unexpected inference output {name!r} for model {self.name!r}; it "
                    f"gives {list(self.outputs)}",
                )
            specs.append(spec)
        return specs


class Backend(Protocol):
    """The server, as its fronts use it."""

    @property
    def models(self) -> Mapping[str, ServedModel]: ...

    @property
    def max_request_bytes(self) -> int: ...

    @property
    def body_timeout(self) -> float: ...

    @property
    def accepting(self) -> bool: ...

    def ready(self) -> bool: ...

    def server_metadata(self) -> dict[str, Any]: ...

    def model(self, name: str, version: str = "") -> ServedModel: ...

    def request(self) -> contextlib.AbstractContextManager[None]: ...

    async def infer(
        self,
        model: ServedModel,
        inputs: Mapping[str, _Array],
        outputs: Sequence[TensorSpec],
        timeout: float | None,
    ) -> list[_Array]: ...
