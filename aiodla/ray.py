"""Ray Serve: one engine per Jetson, many Jetsons as one service.

Each Serve replica holds one :class:`~aiodla.Engine` and claims the box's DLA cores as
the Ray custom resource ``"DLA"``, which every node advertises for itself
(``ray start --resources '{"DLA": 2}'``; :func:`ray_resources` says what to give). Ray
places the replicas, Serve routes requests between them, replaces a replica whose engine
the device killed, and reschedules a replica whose node died::

    from ray import serve
    import aiodla.ray

    handle = serve.run(aiodla.ray.deployment("model.bin", num_replicas=3))
    y = await handle.infer.remote(frame)        # what Engine.infer returns

Install with ``pip install 'aiodla[ray]'``. This module is imported by nothing else in
aiodla, so the library itself never needs Ray.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

try:
    import ray
    from ray import serve
except ImportError as exc:  # pragma: no cover - the tests run where Ray is installed
    raise ImportError(
        f"aiodla.ray needs Ray Serve, which is not installed ({exc}); "
        "install it with: pip install 'aiodla[ray]'"
    ) from exc

from ._engine import Engine, ModelSource
from ._errors import ConfigurationError, EngineClosedError
from ._inspection import DLA_RESOURCE
from ._inspection import dla_resources as ray_resources
from ._options import EngineOptions
from ._statistics import EngineHealth, EngineStatistics
from ._tensors import TensorSpec
from .runtime._select import RUNTIME_CHOICES

__all__ = ["DLA_RESOURCE", "DLAReplica", "ReplicaInfo", "deployment", "ray_resources"]

"""The Ray custom resource that counts a node's DLA cores."""


@dataclasses.dataclass(frozen=True)
class ReplicaInfo:
    """Where a replica runs: its Ray node, actor and Serve replica, host and process."""

    node_id: str
    actor_id: str
    replica_id: str
    hostname: str
    pid: int


class DLAReplica:
    """The Serve deployment's class: one engine, opened in the replica's event loop.

    Build the deployment with :func:`deployment` rather than by hand: it requests the DLA
    resource and keeps one replica per node. Every method is called through a Serve
    handle, e.g. ``await handle.infer.remote(frame)``.
    """

    # Serve awaits an async constructor on the replica's user-code event loop, the loop
    # that later runs every request: the engine must be opened on the loop that calls
    # it (Engine refuses calls from another loop). Ray's own replica does the same.
    async def __init__(  # type: ignore[misc]
        self, model: ModelSource, runtime: str, engine_options: Mapping[str, Any]
    ) -> None:
        self._engine: Engine | None = None
        context = ray.get_runtime_context()
        self._info = ReplicaInfo(
            node_id=context.get_node_id(),
            actor_id=context.get_actor_id() or "",
            replica_id=serve.get_replica_context().replica_id.unique_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )
        # Last, so that nothing after it can fail and leave the engine open.
        engine = Engine(model, runtime=runtime, **engine_options)
        await engine.open()
        self._engine = engine

    @property
    def engine(self) -> Engine:
        """This replica's open engine, for subclasses that add methods (pre- and
        post-processing beside the DLA, say); pass the subclass to :func:`deployment`."""
        engine = self._engine
        if engine is None:  # only between Serve's destructor call and the replica's end
            raise EngineClosedError("this replica's engine is closed")
        return engine

    async def infer(self, inputs: Any, *, timeout: float | None = None) -> Any:
        """``Engine.infer(inputs, timeout=timeout)`` on this replica's engine: an array
        for a single-output model, else a dict name → array. Engine errors reach the
        caller as themselves (Ray's error is also an instance of the engine's class).

        Cancellation: cancelling the handle's response cancels the engine's call, with
        :meth:`aiodla.Engine.infer`'s guarantees (queued work is removed; submitted
        work finishes on the DLA and its result is dropped).
        """
        return await self.engine.infer(inputs, timeout=timeout)

    async def infer_where(
        self, inputs: Any, *, timeout: float | None = None
    ) -> tuple[Any, ReplicaInfo]:
        """:meth:`infer`, with where it ran: for tracing and for tests that show a
        fleet sharing the load. Cancellation: as :meth:`infer`."""
        return await self.infer(inputs, timeout=timeout), self._info

    # The methods below are coroutines although they never wait: Serve runs a plain
    # method in a worker thread, and only the engine's loop thread may read its state.

    async def where(self) -> ReplicaInfo:
        """Where this replica runs."""
        return self._info

    async def inputs(self) -> tuple[TensorSpec, ...]:
        """The model's input tensors, for clients that shape their frames by them."""
        return self.engine.inputs

    async def outputs(self) -> tuple[TensorSpec, ...]:
        """The model's output tensors."""
        return self.engine.outputs

    async def statistics(self) -> EngineStatistics:
        """This replica's ``Engine.statistics()`` (one replica's, not the fleet's)."""
        return self.engine.statistics()

    async def health(self) -> EngineHealth:
        """This replica's ``Engine.health()``."""
        return self.engine.health()

    async def check_health(self) -> None:
        """Serve's periodic health check: a dead engine (the device broke it, only a new
        process can use the DLA again) or a closed one fails it, so Serve replaces the
        replica. A degraded engine still serves on its other core and stays."""
        health = await self.health()
        if health.status in ("dead", "closed"):
            raise RuntimeError(f"aiodla engine {health.status}: {health.reason}")

    # Serve calls __del__ once, on the replica's loop, when it stops the replica, and
    # awaits what it returns (a coroutine); the garbage collector's later call finds the
    # engine gone and returns nothing. An async def __del__ would hand that later call
    # an unawaited coroutine.
    def __del__(self) -> Awaitable[None] | None:
        # getattr: Serve may call it on a replica whose constructor failed early.
        engine: Engine | None = getattr(self, "_engine", None)
        self._engine = None
        if engine is None:
            return None
        return engine.aclose()

    def __repr__(self) -> str:
        info = getattr(self, "_info", None)
        where = "starting" if info is None else f"node {info.node_id[:8]}"
        return f"<DLAReplica {where} {self._engine!r}>"


def deployment(
    model: ModelSource,
    *,
    cores: Sequence[int] = (0, 1),
    num_replicas: int | str = 1,
    runtime: str = "auto",
    name: str = "aiodla",
    serve_options: Mapping[str, Any] | None = None,
    replica: type[DLAReplica] = DLAReplica,
    **engine_options: Any,
) -> serve.Application:
    """A Serve application of ``num_replicas`` engines of ``model``, one per node.

    Each replica opens ``Engine(model, runtime=runtime, cores=cores, **engine_options)``
    and requests ``len(cores)`` units of the ``"DLA"`` resource, so Ray places replicas
    only on nodes started with it (``ray start --resources '{"DLA": 2}'``). Ray counts
    units, not which cores, so at most one replica runs per node
    (``max_replicas_per_node=1``): give a replica all of its box's cores. ``model`` is
    a path that exists on every node, or the loadable's bytes (shipped with the app).

    ``serve_options`` go to ``serve.deployment`` and win over these defaults, e.g.
    ``{"health_check_period_s": 2}``; its ``ray_actor_options["resources"]`` are merged
    with the DLA request. ``max_ongoing_requests`` defaults to what the engine admits
    (its slots and ``max_queue``): the engine, not Serve, queues a replica's requests.

    ``replica`` is the deployment's class: :class:`DLAReplica` or a subclass of it that
    adds methods, which the handle then offers too.

    Run it with ``handle = serve.run(deployment(...))``; then
    ``await handle.infer.remote(frame)``.
    """
    if runtime not in RUNTIME_CHOICES:
        raise ConfigurationError(f"runtime={runtime!r} must be one of {RUNTIME_CHOICES}")
    # Validate the engine's options here, on the driver, rather than in a replica that
    # Serve would then restart forever.
    options = {**engine_options, "cores": tuple(cores)}
    checked = EngineOptions.from_keywords(options)
    chosen = dict(serve_options or {})
    actor_options = dict(chosen.pop("ray_actor_options", None) or {})
    resources = {DLA_RESOURCE: float(len(checked.cores)), **actor_options.get("resources", {})}
    actor_options["resources"] = resources
    admitted = len(checked.cores) * checked.streams_per_core + checked.max_queue
    settings: dict[str, Any] = {
        "name": name,
        "num_replicas": num_replicas,
        "max_replicas_per_node": 1,
        "max_ongoing_requests": admitted,
        **chosen,
        "ray_actor_options": actor_options,
    }
    return serve.deployment(**settings)(replica).bind(model, runtime, options)
