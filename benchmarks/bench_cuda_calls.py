"""What the runtime calls of one request cost the host, alone, on one thread.

The floor under ``bench_threads.py``'s host cost: an engine is opened on one core with
one slot (bench_gpu.py's model), and each piece of a request's device work is timed
back to back on the calling thread, with no event loop and no poller competing for the
GIL: CPU microseconds per call (``time.process_time``), medians over ``--repeats``
interleaved repeats (min..max).

- ``submit, each call``: the device layer's submission as ``Engine(graphs=False)``
  makes it (copy in, pack kernel, cudlaSubmitTask, unpack kernel, copy out, event);
- ``submit, graphs``: the same with the slot's two graphs (launch, submit, launch);
- the single runtime calls inside them, and the poller's per-completion pair
  (``cudaEventQuery`` and ``cudlaGetLastError``), and staging and reading the bytes.

Usage (GPU machine, stand-in built; ``--runtime emulated`` dry-runs it here)::

    python benchmarks/bench_cuda_calls.py [--convert device|host] [--calls 2000]
        [--repeats 5] [--gap SECONDS] [--json PATH]

``--gap 0.0038`` idles 3.8 ms before each timed call: what a call costs when the host
and the GPU wait between tasks, as at long service times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import bench_gpu

from aiodla import Engine
from aiodla.runtime import EmulatedRuntime

SYNC_EVERY = 32  # keep the stream's queue short: a full queue blocks the enqueuing call


def per_call(
    calls: int, sync: Callable[[], None], call: Callable[[], Any], gap: float = 0.0
) -> float:
    """CPU microseconds per ``call()``, synchronizing every SYNC_EVERY calls (timed too:
    what a queue that drains costs belongs to the call's share). With a ``gap``, the
    thread sleeps that long before each call, which alone is timed: a call made after
    the host and the GPU sat idle, as at long service times."""
    call()
    sync()
    if gap:
        spent = 0.0
        for _ in range(calls):
            time.sleep(gap)
            began = time.process_time()
            call()
            spent += time.process_time() - began
            sync()
        return spent / calls * 1e6
    began = time.process_time()
    for index in range(calls):
        call()
        if index % SYNC_EVERY == SYNC_EVERY - 1:
            sync()
    sync()
    return (time.process_time() - began) / calls * 1e6


async def one_engine(runtime: Any, args: argparse.Namespace, graphs: bool) -> dict[str, float]:
    """The submission's cost on an engine with or without graphs; without, its pieces."""
    figures: dict[str, float] = {}
    x = bench_gpu.sample()
    async with Engine(
        bench_gpu.model_bytes(0.0),
        runtime=runtime,
        cores=[0],
        streams_per_core=1,
        convert=args.convert,
        graphs=graphs,
    ) as engine:
        cores = engine._device
        slot = cores.slots[0]
        stream = slot.stream
        path = cores.path
        assert path is not None

        def sync() -> None:
            runtime.synchronize_stream(stream)

        cores.write_inputs(slot, [x])
        name = "submit, graphs" if graphs else "submit, each call"
        figures[name] = per_call(args.calls, sync, lambda: cores.submit(slot, 0.0), args.gap)
        if graphs:
            return figures
        # The pieces, on the same slot: the calls the device layer makes.
        pieces: dict[str, Callable[[], Any]] = {
            "stage the input (numpy)": lambda: cores.write_inputs(slot, [x]),
            "read the output (numpy)": lambda: cores.read_outputs(slot),
            "inputs: copy and pack": lambda: path.enqueue_inputs(slot),
            "cudlaSubmitTask": lambda: runtime.submit_task(slot.core.device, slot.task, stream),
            "outputs: unpack and copy": lambda: path.enqueue_outputs(slot, False),
            "cudaEventRecord": lambda: runtime.record_event(slot.event, stream),
            "poller: event query and status": lambda: (
                runtime.query_event(slot.event),
                runtime.get_last_error(slot.core.device),
            ),
        }
        for piece, call in pieces.items():
            figures[piece] = per_call(args.calls, sync, call, args.gap)
    return figures


async def one_repeat(runtime: Any, args: argparse.Namespace) -> dict[str, float]:
    figures = await one_engine(runtime, args, graphs=False)
    figures.update(await one_engine(runtime, args, graphs=True))
    figures["graphs / each call"] = figures["submit, graphs"] / figures["submit, each call"]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", choices=("cuda", "emulated"), default="cuda")
    parser.add_argument("--convert", choices=("device", "host"), default="device")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--gap", type=float, default=0.0, help="seconds idle before each call (0: back to back)"
    )
    parser.add_argument("--standin", default=None)
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("--host-fake", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.runtime == "cuda":
        import os

        args.standin = args.standin or os.environ.get("AIODLA_STANDIN_LIB")
        bench_gpu.setup_standin(args)
        runtime: Any = bench_gpu.CudaRuntime(0)
        runtime.make_current()
    else:
        runtime = EmulatedRuntime()
    repeats = [asyncio.run(one_repeat(runtime, args)) for _ in range(args.repeats)]
    print(
        f"CPU us per call, one thread, {args.runtime} runtime, {args.convert} conversion, "
        f"{f'{args.gap * 1e3:g} ms idle before each' if args.gap else 'back to back'}; "
        f"median of {args.repeats} (min..max)"
    )
    summary = {}
    for name in repeats[0]:
        values = [r[name] for r in repeats]
        summary[name] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }
        unit = "" if "/" in name else " us"
        print(
            f"  {name:34s} {summary[name]['median']:8.2f}{unit} "
            f"({summary[name]['min']:.2f}..{summary[name]['max']:.2f})"
        )
    if args.json:
        report = {
            "runtime": args.runtime,
            "convert": args.convert,
            "gap": args.gap,
            "results": summary,
        }
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
