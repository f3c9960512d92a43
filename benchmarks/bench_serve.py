"""What ``aiodla serve`` costs: requests/s and latency through HTTP and gRPC against
``Engine.infer`` called directly, on the same emulated model.

The server runs as ``aiodla serve`` in a process of its own (as it does in use); the
clients are Triton's asyncio clients (``tritonclient.http.aio`` with binary tensors,
``tritonclient.grpc.aio``) in this process, keeping ``--concurrency`` requests in
flight. Direct calls use an engine of the same model in this process. The three ways
are interleaved within each repeat, so drift in the machine touches all of them; the
report gives medians over the repeats with min..max, and the ratios to direct calls.

Usage::

    python benchmarks/bench_serve.py [--requests 1000] [--repeats 5] [--concurrency 8]
                                     [--service 0.001] [--json PATH]

On a 2-core machine the client, the server and the emulated device share the cores:
the figures bound the server's overhead from above.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as tgrpc
import tritonclient.http.aio as thttp
from _reports import report_path

from aiodla import Engine, TensorSpec
from aiodla.emulator import make_loadable

ROOT = Path(__file__).resolve().parent.parent
SHAPE = (1, 3, 32, 32)
WAYS = ("direct", "http", "grpc")


def model(service: float) -> bytes:
    x = TensorSpec("x", SHAPE, "float16", "chw16")
    y = TensorSpec("y", SHAPE, "float32", "nchw")
    return make_loadable([x], [y], "affine", service, scale=2.0, bias=0.5)


async def run_requests(call: Any, requests: int, concurrency: int) -> dict[str, float]:
    latencies: list[float] = []
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "rps": requests / elapsed,
        "p50_ms": 1e3 * latencies[len(latencies) // 2],
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


async def start_server(path: Path) -> tuple[asyncio.subprocess.Process, int, int]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiodla", "serve", f"bench={path}", "--runtime", "emulated",
        "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--cores", "0,1",
        stderr=asyncio.subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert process.stderr is not None
    line = (await asyncio.wait_for(process.stderr.readline(), 60)).decode()
    found = re.search(r"HTTP port (\d+); gRPC port (\d+)", line)
    if not found:
        raise RuntimeError(f"aiodla serve did not start: {line}")
    return process, int(found[1]), int(found[2])


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    data = model(args.service)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"aiodla-bench-serve-{os.getpid()}.bin"
    path.write_bytes(data)
    process, http_port, grpc_port = await start_server(path)
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float16)
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    try:
        async with Engine(data, runtime="emulated", cores=[0, 1]) as engine:
            http = thttp.InferenceServerClient(
                f"127.0.0.1:{http_port}", conn_limit=args.concurrency
            )
            grpc = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            http_in = thttp.InferInput("x", list(SHAPE), "FP16")
            http_in.set_data_from_numpy(x, binary_data=True)
            http_out = [thttp.InferRequestedOutput("y", binary_data=True)]
            grpc_in = tgrpc.InferInput("x", list(SHAPE), "FP16")
            grpc_in.set_data_from_numpy(x)
            expected = await engine.infer(x)

            async def direct() -> None:
                await engine.infer(x)

            async def over_http() -> None:
                await http.infer("bench", [http_in], outputs=http_out)

            async def over_grpc() -> None:
                await grpc.infer("bench", [grpc_in])

            calls = {"direct": direct, "http": over_http, "grpc": over_grpc}
            # The answers are the engine's, byte for byte, before anything is timed.
            got_http = (await http.infer("bench", [http_in], outputs=http_out)).as_numpy("y")
            got_grpc = (await grpc.infer("bench", [grpc_in])).as_numpy("y")
            assert got_http.tobytes() == got_grpc.tobytes() == expected.tobytes()
            for way in WAYS:  # warm-up
                await run_requests(calls[way], min(200, args.requests), args.concurrency)
            for repeat in range(args.repeats):
                order = WAYS if repeat % 2 == 0 else WAYS[::-1]
                for way in order:
                    runs[way].append(
                        await run_requests(calls[way], args.requests, args.concurrency)
                    )
            await http.close()
            await grpc.close()
    finally:
        process.terminate()
        await process.wait()
        path.unlink()
    report: dict[str, Any] = {
        "benchmark": "bench_serve",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "model": {
            "shape": list(SHAPE),
            "input": "float16 chw16",
            "output": "float32",
            "service_s": args.service,
        },
        "cores": [0, 1],
        "streams_per_core": 2,
        "concurrency": args.concurrency,
        "requests_per_run": args.requests,
        "repeats": args.repeats,
        "ideal_rps": 2 / args.service if args.service else None,
        "results": {},
        "runs": runs,
    }
    for way in WAYS:
        report["results"][way] = {
            key: summary([r[key] for r in runs[way]]) for key in ("rps", "p50_ms", "p99_ms")
        }
    direct_rps = report["results"]["direct"]["rps"]["median"]
    direct_p50 = report["results"]["direct"]["p50_ms"]["median"]
    for way in ("http", "grpc"):
        result = report["results"][way]
        result["rps_ratio_to_direct"] = result["rps"]["median"] / direct_rps
        result["p50_ratio_to_direct"] = result["p50_ms"]["median"] / direct_p50
    return report


def show(report: dict[str, Any]) -> None:
    print(
        f"model 1x3x32x32 fp16 -> fp32, {report['model']['service_s'] * 1e3:g} ms service, "
        f"cores 0,1 x 2 streams, concurrency {report['concurrency']}, "
        f"{report['requests_per_run']} requests x {report['repeats']} repeats (median, min..max)"
    )
    for way in WAYS:
        r = report["results"][way]
        line = f"{way:<7}"
        for key, unit in (("rps", "req/s"), ("p50_ms", "ms p50"), ("p99_ms", "ms p99")):
            s = r[key]
            line += f"  {s['median']:8.1f} {unit} ({s['min']:.1f}..{s['max']:.1f})"
        if way != "direct":
            line += f"  | x{r['rps_ratio_to_direct']:.2f} throughput, x{r['p50_ratio_to_direct']:.2f} p50 of direct"
        print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--service", type=float, default=0.001)
    parser.add_argument("--json", help="report path (default: a temporary file)")
    arguments = parser.parse_args()
    result = asyncio.run(main(arguments))
    show(result)
    path = report_path(arguments.json, "serve-emulated.json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
