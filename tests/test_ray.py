"""aiodla.ray: Ray Serve replicas on a local two-node Ray cluster (emulated runtime).

The cluster is real (``ray.cluster_utils.Cluster``: a raylet per node, each node with
``{"DLA": 2}``), shared by the module and started once: about 15 s on two CPU cores.
The node-loss test is the slow one (marked below): Ray has to notice the dead node and
Serve to reschedule its replica on a node added back. Skipped where Ray Serve is not
installed (``pip install 'aiodla[ray]'``).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
cluster_utils = pytest.importorskip("ray.cluster_utils")

import aiodla.ray as dla_ray  # noqa: E402 - after the skips, it needs Ray
from aiodla import (  # noqa: E402
    AiodlaError,
    ConfigurationError,
    DeviceError,
    Engine,
    EngineDeadError,
    InputError,
)
from aiodla.runtime._select import cuda_probe  # noqa: E402

from support import affine_model  # noqa: E402

MODEL = affine_model(0.002)
SHAPE = (1, 3, 8, 8)

# Each raylet declares one CPU: the replicas (one CPU each, Serve's default) then fit
# one per node, and Ray starts no more worker processes than the two cores can run.
NODE = {"num_cpus": 1, "resources": {"DLA": 2}}
# A node killed without warning is declared dead after ~1 s of failed health checks
# (Ray's default is 3 s x 5 checks), so the test waits on Ray for seconds, not tens.
FAST_NODE_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 2,
}


def frames(count: int, seed: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(np.float16) for _ in range(count)]


async def local_results(inputs: list[np.ndarray[Any, Any]]) -> list[Any]:
    """What a plain Engine returns for the same model and inputs, in this process."""
    async with Engine(MODEL, runtime="emulated") as engine:
        return list(await asyncio.gather(*(engine.infer(x) for x in inputs)))


# -- without a cluster ------------------------------------------------------------------


def test_importing_without_ray_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "try:\n    import aiodla.ray\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "pip install 'aiodla[ray]'" in out.stdout


@pytest.mark.timeout(120)
def test_the_example_serves_every_frame() -> None:
    """examples/ray_serve_app.py as a user runs it: a Ray of its own (about 20 s)."""
    example = Path(__file__).parent.parent / "examples" / "ray_serve_app.py"
    out = subprocess.run(
        [sys.executable, str(example), "--cameras", "2", "--frames", "10"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "20 frames from 2 cameras" in out.stdout, out.stdout
    assert re.search(r"^ +20 served by ", out.stdout, re.MULTILINE), out.stdout
    assert "health of a replica: ok" in out.stdout


class TestRayResources:
    def test_emulated_gives_the_emulated_cores(self) -> None:
        assert dla_ray.ray_resources("emulated") == {"DLA": 2.0}

    def test_auto_counts_cudla_cores_or_gives_nothing(self) -> None:
        expected = dla_ray.ray_resources("cuda") if cuda_probe()[0] else {}
        assert dla_ray.ray_resources() == expected

    def test_a_bad_runtime_is_refused(self) -> None:
        with pytest.raises(ConfigurationError, match="runtime='gpu'"):
            dla_ray.ray_resources("gpu")


class TestDeploymentArguments:
    """Refused on the driver, before Serve would retry a failing replica forever."""

    def test_a_bad_engine_option(self) -> None:
        with pytest.raises(ConfigurationError, match="streams_per_cor"):
            dla_ray.deployment(MODEL, streams_per_cor=2)

    def test_a_bad_runtime(self) -> None:
        with pytest.raises(ConfigurationError, match="runtime='gpu'"):
            dla_ray.deployment(MODEL, runtime="gpu")

    def test_bad_cores(self) -> None:
        with pytest.raises(ConfigurationError, match="cores"):
            dla_ray.deployment(MODEL, cores=())


# -- on a two-node cluster ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    made = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={**NODE, "include_dashboard": False, "_system_config": FAST_NODE_DEATH},
    )
    try:
        made.add_node(**NODE)
        made.wait_for_nodes()
        ray.init(address=made.address, log_to_driver=False)
        # No HTTP proxy: the tests use handles, and a proxy is one more process.
        serve.start(proxy_location="Disabled")
        yield made
    finally:
        serve.shutdown()
        ray.shutdown()
        made.shutdown()


@pytest.fixture(scope="module")
def handle(cluster: Any) -> Any:
    # The replica class is defined here, in a module Ray's workers cannot import.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    app = dla_ray.deployment(
        MODEL,
        num_replicas=2,
        runtime="emulated",
        name="dla",
        replica=PoisonableReplica,
        serve_options={"health_check_period_s": 1.0, "health_check_timeout_s": 5.0},
    )
    return serve.run(app, name="dla", route_prefix=None)


class PoisonableReplica(dla_ray.DLAReplica):
    """The deployment's class, plus a way to break its engine as a DLA fault would."""

    async def poison(self) -> dla_ray.ReplicaInfo:
        self.engine.runtime.poison()  # type: ignore[attr-defined]
        return await self.where()


def alive_node_ids() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


@pytest.mark.asyncio
@pytest.mark.timeout(120)
class TestTwoNodes:
    async def test_both_nodes_serve_and_results_match_the_engine(self, handle: Any) -> None:
        inputs = frames(40, seed=1)
        served = await asyncio.gather(*(handle.infer_where.remote(x) for x in inputs))
        for (result, _), expected in zip(served, await local_results(inputs)):
            assert result.dtype == expected.dtype
            np.testing.assert_array_equal(result, expected)
        assert {info.node_id for _, info in served} == alive_node_ids()
        # infer itself returns what Engine.infer returns, nothing more.
        plain = await handle.infer.remote(inputs[0])
        np.testing.assert_array_equal(plain, served[0][0])

    async def test_each_replica_claims_its_nodes_dla_cores(self, handle: Any) -> None:
        await handle.where.remote()
        assert ray.cluster_resources()["DLA"] == 4.0
        assert ray.available_resources().get("DLA", 0.0) == 0.0

    async def test_statistics_and_health_come_from_the_replica(self, handle: Any) -> None:
        await handle.infer.remote(frames(1, seed=2)[0])
        stats = await handle.statistics.remote()
        assert stats.state == "open" and stats.completed >= 1
        assert len(stats.cores) == 2
        health = await handle.health.remote()
        assert health.ok, health
        [x] = await handle.inputs.remote()
        [y] = await handle.outputs.remote()
        assert (x.name, x.shape, y.name) == ("x", SHAPE, "y")

    async def test_engine_errors_reach_the_caller_as_themselves(self, handle: Any) -> None:
        with pytest.raises(InputError, match="shape"):
            await handle.infer.remote(np.zeros((1, 3, 4, 4), np.float16))

    async def test_serve_replaces_a_replica_whose_engine_died(self, handle: Any) -> None:
        """The device breaks one replica's engine: the requests that meet it fail with
        aiodla's error, the health check fails, and Serve starts a new replica there."""
        x = frames(1, seed=4)[0]
        broken = await handle.poison.remote()
        failures: list[AiodlaError] = []
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the replica was not replaced in time"
            try:
                _, info = await handle.infer_where.remote(x)
            except AiodlaError as exc:
                failures.append(exc)
                await asyncio.sleep(0.05)
                continue
            assert info.actor_id != broken.actor_id, "a dead engine served a request"
            if info.node_id == broken.node_id:
                break  # its replacement
        assert failures and all(isinstance(e, (EngineDeadError, DeviceError)) for e in failures)
        for _ in range(10):
            assert (await handle.health.remote()).ok


# -- slow (about a minute): a node dies --------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(150)
async def test_a_node_dies_under_load_and_the_deployment_recovers(
    cluster: Any, handle: Any
) -> None:
    """Cameras keep sending while one node is killed without warning: only requests
    that node's replica held fail, every retry lands on the survivor, and the replica
    comes back on a node added in its place."""
    inputs = frames(8, seed=3)
    expected = await local_results(inputs)
    head = cluster.head_node.node_id
    [worker] = [node for node in cluster.worker_nodes]
    replicas = {
        info.node_id: info
        for _, info in await asyncio.gather(*(handle.infer_where.remote(x) for x in inputs))
    }
    assert set(replicas) == {head, worker.node_id}
    doomed = replicas[worker.node_id]

    failures: list[BaseException] = []
    served_by: list[str] = []
    stop = asyncio.Event()

    async def camera(index: int) -> None:
        x, want = inputs[index], expected[index]
        while not stop.is_set():
            try:
                result, info = await handle.infer_where.remote(x)
            except ray.exceptions.RayActorError as exc:  # Serve's advice: retry
                failures.append(exc)
                continue
            np.testing.assert_array_equal(result, want)
            served_by.append(info.node_id)

    async def served_after(count: int, node: str, deadline: float) -> None:
        start = len(served_by)
        while served_by[start:].count(node) < count:
            assert time.monotonic() < deadline, "not served in time"
            await asyncio.sleep(0.05)

    cameras = [asyncio.create_task(camera(i)) for i in range(len(inputs))]
    try:
        deadline = time.monotonic() + 60
        await served_after(20, worker.node_id, deadline)
        cluster.remove_node(worker, allow_graceful=False)
        # The replica's process outlives its raylet until it notices; once Ray has
        # declared the node dead, only the survivor serves.
        while worker.node_id in alive_node_ids():
            assert time.monotonic() < deadline, "the node was not declared dead"
            await asyncio.sleep(0.05)
        dead_at = len(served_by)
        await served_after(100, head, deadline)  # the survivor carries the load

        # The replica is rescheduled once a node with DLA cores joins again.
        replacement = cluster.add_node(**NODE)
        await served_after(20, replacement.node_id, time.monotonic() + 60)
    finally:
        stop.set()
        await asyncio.gather(*cameras)

    # Every failure was a request the killed replica held or was sent before Serve
    # knew it dead: never one of the survivor's.
    assert all(exc.actor_id == doomed.actor_id for exc in failures), failures
    # Each camera loses at most the request it had in flight there and one sent before
    # Serve's router learned of the death.
    assert len(failures) <= 2 * len(inputs), failures
    assert worker.node_id not in served_by[dead_at + len(inputs) :]
    assert (await handle.health.remote()).ok
