"""The GPU stand-in's own ceiling: how close to ``cores / service_time`` its cores run
back-to-back tasks when no host is in the way.

aiodla's x-ideal on the stand-in cannot pass what the stand-in itself reaches: each of its
tasks is a kernel that waits for the core's previous task through a CUDA event, and that
hand-over costs GPU time a real DLA does not spend. This measures it with the host out of
the picture: on both cores, ``--streams`` slots per core (bench_gpu's ``Slot``: device,
module, buffers, task) each get ``--tasks`` requests enqueued (copy in, task, copy out:
the work aiodla's graphs hold, or ``--task-only``) while the cores are held at the
stand-in's gate; then both cores are released at once, and the rate is the tasks over
the wall time from the release to the last stream's end. Repeated, median and min..max.

Usage (on the GPU machine)::

    python benchmarks/bench_standin_ceiling.py [--repeats 5] [--tasks 100] [--streams 4]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from bench_gpu import CORES, Slot, model_bytes, sample, setup_standin

from aiodla.runtime._cuda import CudaRuntime

SERVICE_TIMES = (1e-4, 1e-3)


def one_run(
    runtime: CudaRuntime, controls: Any, slots: list[Slot], tasks: int, task_only: bool
) -> float:
    """Tasks per second over the cores' ideal rate, the cores fed ahead of time."""
    x = sample()
    gates = [controls.hold(core) for core in CORES]
    try:
        for _ in range(tasks):
            for slot in slots:
                if task_only:
                    runtime.submit_task(slot.device, slot.task, slot.stream)
                else:
                    slot.enqueue(x)
        for gate in gates:
            if not gate.wait_for_held(1):
                raise RuntimeError("a core's first task never reached the gate")
    finally:
        started = time.perf_counter()
        for gate in gates:
            gate.release()
    for slot in slots:
        runtime.synchronize_stream(slot.stream)
    elapsed = time.perf_counter() - started
    return tasks * len(slots) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=100, help="requests per slot per run")
    parser.add_argument("--streams", type=int, default=4, help="slots per core")
    parser.add_argument("--task-only", action="store_true", help="no copies around the task")
    parser.add_argument("--json", default=None)
    parser.add_argument("--standin", default=None)
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("--host-fake", action="store_true")
    args = parser.parse_args()
    args.standin = args.standin or os.environ.get("AIODLA_STANDIN_LIB")
    controls, path = setup_standin(args)
    runtime = CudaRuntime(0)
    runtime.make_current()
    report: dict[str, Any] = {"standin": str(path), "config": vars(args), "results": {}}
    for service in SERVICE_TIMES:
        data = model_bytes(service)
        slots = [Slot(runtime, data, core) for core in CORES for _ in range(args.streams)]
        try:
            one_run(runtime, controls, slots, 5, args.task_only)  # warm-up
            rates = [
                one_run(runtime, controls, slots, args.tasks, args.task_only)
                for _ in range(args.repeats)
            ]
        finally:
            for slot in slots:
                slot.close()
        ideal = len(CORES) / service
        ratios = [r / ideal for r in rates]
        row = {
            "ideal": ideal,
            "rate": statistics.median(rates),
            "x_ideal": {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            },
            "gap_us_per_task": 1e6 * (len(CORES) / statistics.median(rates) - service),
        }
        report["results"][f"{service * 1e6:g} us"] = row
        print(
            f"{service * 1e6:6g} us service: {row['rate']:8.0f} tasks/s, "
            f"{row['x_ideal']['median']:.3f} x ideal ({min(ratios):.3f}..{max(ratios):.3f}); "
            f"{row['gap_us_per_task']:.1f} us of each core's time per task beyond the service"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
