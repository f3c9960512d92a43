"""Serve a DLA model on Ray Serve: one engine per box, cameras as clients.

    python examples/ray_serve_app.py                          # a local Ray, emulated DLA
    python examples/ray_serve_app.py --model det.bin          # your loadable on this box
    python examples/ray_serve_app.py --address auto --replicas 3   # a running cluster

Without ``--address`` it starts a Ray of its own on this machine, advertising the DLA
cores found here (``aiodla.ray.ray_resources``) or, without a DLA, the emulated
runtime's two, and serves an emulator loadable unless ``--model`` is given. With
``--address`` it deploys onto a cluster whose nodes were started with
``ray start --resources "$(aiodla devices --ray-resources)"``. Cameras then send frames
through a Serve handle, and the script prints which node served how many of them.
Needs the extra: pip install 'aiodla[ray]'.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from typing import Any

import numpy as np
import ray
from ray import serve

import aiodla.ray
from aiodla import TensorSpec
from aiodla.emulator import make_loadable


def demo_model() -> bytes:
    image = TensorSpec("image", (1, 3, 64, 64), "float16", "chw16")
    scores = TensorSpec("scores", (1, 3, 64, 64), "float16", "nchw")
    return make_loadable([image], [scores], "affine", latency=0.004)


async def camera(
    handle: Any, frame: np.ndarray[Any, Any], frames: int, served: collections.Counter[str]
) -> None:
    for _ in range(frames):
        _scores, where = await handle.infer_where.remote(frame, timeout=5.0)
        served[f"{where.hostname} (node {where.node_id[:8]})"] += 1


async def run_cameras(handle: Any, cameras: int, frames: int) -> None:
    [spec] = await handle.inputs.remote()  # a single-input model, as the demo's
    frame = np.random.default_rng(0).standard_normal(spec.shape).astype(spec.numpy_dtype)
    served: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    await asyncio.gather(*(camera(handle, frame, frames, served) for _ in range(cameras)))
    elapsed = time.perf_counter() - start
    print(f"{cameras * frames} frames from {cameras} cameras in {elapsed:.2f} s")
    for where, count in served.most_common():
        print(f"  {count:5d} served by {where}")
    print("health of a replica:", (await handle.health.remote()).status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a loadable (default: an emulator loadable)")
    parser.add_argument("--address", help="a running Ray cluster, e.g. 'auto'")
    parser.add_argument("--replicas", type=int, default=1, help="one per box with a DLA")
    parser.add_argument("--cameras", type=int, default=4)
    parser.add_argument("--frames", type=int, default=50, help="frames per camera")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        dla = aiodla.ray.ray_resources() or aiodla.ray.ray_resources("emulated")
        # "local": a Ray of its own even where a 'ray start' cluster runs on this box.
        ray.init(address="local", num_cpus=2, resources=dla, include_dashboard=False)
    model = args.model or demo_model()
    app = aiodla.ray.deployment(
        model,
        num_replicas=args.replicas,
        runtime="auto",
        # A log line per frame would drown the summary; errors are still logged.
        serve_options={"logging_config": {"enable_access_log": False}},
    )
    try:
        handle = serve.run(app, name="aiodla", route_prefix=None)
        asyncio.run(run_cameras(handle, args.cameras, args.frames))
    finally:
        serve.delete("aiodla")
        ray.shutdown()


if __name__ == "__main__":
    main()
