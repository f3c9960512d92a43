"""Camera-sized frames through the engine: host conversion against device conversion.

The workload of the GPU data path issue: 1x3x640x640 frames (float32 and uint8) into
an FP16 CHW16 input, out of a 1x255x80x80 FP16 CHW16 head, 3.8 ms a task, both cores.
For each configuration, interleaved and repeated (median and min..max):

- **throughput** against the ideal ``cores / service_time`` (concurrency 16), and
  against what the runtime alone sustains for the same model (``x floor``: tasks back
  to back with no engine; on the GPU stand-in a camera-sized task takes longer than its
  stated service time, see ``device_floor``);
- **host CPU per request**, the whole process (every thread), and by thread (event
  loop, poller, other), against the same figure for a 1x3x32x32 model measured in the
  same run (the floor: what a request costs when its tensors are tiny);
- **event-loop lag**: how late a 1 ms ticker on the loop wakes, p99, while saturated.

Configurations: ``convert="host"`` and ``convert="device"`` with host frames of each
type, and with device frames (CuPy, else torch) when a GPU is there; and raw 1920x1080
BGR camera frames, letterboxed to the model's input by the engine
(``Engine(preprocess=...)``, on either path) or by OpenCV on the host before ``infer``
(what users write today; in a worker thread, as they should). Camera to boxes
(``--only boxes``): 1080p BGR frames into YOLOv5s-shaped heads (``aiodla emulate --preset
yolov5s``), (a) all on the engine: the frame in an engine frame buffer,
``postprocess=Detect(head="yolov5")``, Detections back; (b) the engine's raw heads, then
a careful numpy decode (objectness first) and ``cv2.dnn.NMSBoxesBatched`` in a worker
thread (today's way); against (c) the small 32x32 model.

What is counted: ``CPU us/req`` is the whole process's CPU (every thread) per request,
over a window of ``--seconds`` in which the engine is saturated and nothing else runs;
the loop's lag is measured right after, under the same load, with the 1 ms ticker on
(its own CPU is the harness's, and at the few requests a second of the emulated
640x640 task it would outweigh the engine's).
``host us`` is what the host pays: the process's CPU less the emulated device's work,
which a Jetson's DLA and GPU do, not its CPU: the emulated runtime's stream operations
(copies, conversions, pre-processing, the DLA task's arithmetic and, with device
conversion, the detector's post-processing), as the runtime's ``device_time`` counts
them on whichever thread applies them, and its compute threads (``compute=``). On the
CUDA runtime ``device_time`` is 0: the device's work is not on the CPU there. The kernels' own time
against a device-to-device copy is measured by ``benchmarks/bench_convert_kernels.py``
and ``benchmarks/bench_preprocess_kernels.py``.

Usage::

    python benchmarks/bench_data_path.py [OUTPUT.json] [--gpu] [--repeats 5] [--seconds 2]

``--gpu`` runs on the CUDA runtime with the GPU stand-in (built with nvcc, or
``--standin`` / ``AIODLA_STANDIN_LIB``); without it the emulated runtime runs the same
path with numpy "kernels", which checks the harness but says nothing of GPU speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _reports import report_path
from _standin_lib import load_standin

from aiodla import Detect, Engine, ImagePreprocess, TensorSpec
from aiodla._detect import YOLOV5_ANCHORS
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS

REPO = Path(__file__).resolve().parent.parent
SERVICE = 0.0038
MIN_REQUESTS = 4  # in a CPU window, for a per-request figure of the boxes cases to count
CORES = 2
FRAME = TensorSpec("images", (1, 3, 640, 640), "float16", "chw16")
HEAD = TensorSpec("head", (1, 255, 80, 80), "float16", "chw16")
SMALL_IN = TensorSpec("x", (1, 3, 32, 32), "float16", "chw16")
SMALL_OUT = TensorSpec("y", (1, 3, 32, 32), "float16", "chw16")


def detector(service: float = SERVICE) -> bytes:
    return make_loadable([FRAME], [HEAD], "mix", service)


def yolov5s(service: float = SERVICE) -> bytes:
    """``aiodla emulate --preset yolov5s``: raw heads with a few dozen objects a frame."""
    inputs, outputs, _ = PRESETS["yolov5s"]
    return make_loadable(inputs, outputs, "detect", service)


class HostDecode:
    """What users write today after an engine returns YOLOv5s' raw heads: a careful
    numpy decode that filters on objectness first, then OpenCV's batched NMS, then the
    letterbox undone. Runs in a worker thread, as it should."""

    def __init__(self, frame_size: tuple[int, int], conf: float = 0.25, iou: float = 0.45):
        self.conf, self.iou = conf, iou
        self.logit = float(np.log(conf / (1 - conf)))
        self.geometry = ImagePreprocess(source="bgr", order="rgb", resize="letterbox").geometry(
            *frame_size, *FRAME.shape[2:]
        )

    def __call__(self, heads: dict[str, Any]) -> tuple[Any, Any, Any]:
        import cv2

        found = []
        outputs = PRESETS["yolov5s"][1]
        for spec, stride, anchors in zip(outputs, (8, 16, 32), YOLOV5_ANCHORS, strict=True):
            h, w = spec.shape[2:]
            raw = heads[spec.name].reshape(3, 85, h * w)
            a, cell = np.nonzero(raw[:, 4, :] > self.logit)  # objectness first
            if not len(cell):
                continue
            t = 1 / (1 + np.exp(-raw[a, :, cell].astype(np.float32)))  # (n, 85)
            cls = t[:, 5:].argmax(1)
            score = t[:, 4] * t[np.arange(len(cls)), 5 + cls]
            keep = score > self.conf
            t, a, cell, cls, score = t[keep], a[keep], cell[keep], cls[keep], score[keep]
            pairs = np.array(anchors, np.float32).reshape(3, 2)[a]
            cx = (t[:, 0] * 2 - 0.5 + cell % w) * stride
            cy = (t[:, 1] * 2 - 0.5 + cell // w) * stride
            bw, bh = (t[:, 2] * 2) ** 2 * pairs[:, 0], (t[:, 3] * 2) ** 2 * pairs[:, 1]
            found.append(np.stack([cx - bw / 2, cy - bh / 2, bw, bh, score, cls], 1))
        if not found:
            return np.empty((0, 4)), np.empty(0), np.empty(0)
        rows = np.concatenate(found)
        kept = cv2.dnn.NMSBoxesBatched(
            rows[:, :4].tolist(), rows[:, 4].tolist(), rows[:, 5].astype(int).tolist(),
            self.conf, self.iou,
        )  # fmt: skip
        rows = rows[np.asarray(kept, int).reshape(-1)][:300]
        g = self.geometry
        boxes = np.stack(
            [(rows[:, 0] - g.left) / g.scale_x, (rows[:, 1] - g.top) / g.scale_y,
             (rows[:, 0] + rows[:, 2] - g.left) / g.scale_x,
             (rows[:, 1] + rows[:, 3] - g.top) / g.scale_y], 1,
        )  # fmt: skip
        return boxes, rows[:, 4], rows[:, 5]


def small(service: float = SERVICE) -> bytes:
    return make_loadable([SMALL_IN], [SMALL_OUT], "affine", service, scale=2.0, bias=0.5)


def thread_cpu(thread: threading.Thread) -> float:
    if thread.ident is None or not thread.is_alive():
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, ProcessLookupError):
        return 0.0


def device_seconds(engine: Engine) -> float:
    """CPU seconds the emulated runtime spent on the device's work (0 elsewhere)."""
    return float(getattr(engine.runtime, "device_time", 0.0))


def cpu_by_thread() -> dict[str, float]:
    groups = {"loop": time.thread_time(), "poller": 0.0, "other": 0.0, "dla": 0.0}
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is current:
            continue
        key = "poller" if thread.name == "aiodla-poller" else "other"
        if thread.name.startswith("aiodla-emulated-compute"):
            key = "dla"  # the emulated DLA's own work: device time on a Jetson
        groups[key] += thread_cpu(thread)
    groups["process"] = time.process_time()
    return groups


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        due = loop.time() + 0.001
        await asyncio.sleep(0.001)
        lags.append(max(0.0, loop.time() - due))


def opencv_letterbox(frame: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The host pre-processing users write today: OpenCV letterbox, RGB, scale to [0, 1],
    NCHW float16, then ``infer``."""
    import cv2

    height, width = FRAME.shape[2:]
    scale = min(height / frame.shape[0], width / frame.shape[1])
    new_w, new_h = round(frame.shape[1] * scale), round(frame.shape[0] * scale)
    resized = cv2.resize(frame, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    canvas = cv2.copyMakeBorder(
        resized,
        top,
        height - new_h - top,
        left,
        width - new_w - left,
        cv2.BORDER_CONSTANT,
        value=(114, 114, 114),
    )
    rgb = cv2.cvtColor(canvas, cv2.COLOR_BGR2RGB)
    return (rgb.transpose(2, 0, 1)[np.newaxis].astype(np.float32) / 255).astype(np.float16)


async def measure(
    model: bytes,
    make_input: Any,
    seconds: float,
    options: dict[str, Any],
    prepare: Any = None,
    service: float = SERVICE,
) -> dict[str, float]:
    options = dict(options)
    finish = options.pop("finish", None)  # the host's work on each result, in a thread
    in_buffer = options.pop("frame_buffer", False)  # the frame in an engine frame buffer
    async with Engine(model, cores=range(CORES), streams_per_core=4, **options) as engine:
        x = make_input()
        if in_buffer:
            x = in_frame_buffer(engine, x)
        for _ in range(8):
            await engine.infer(x if prepare is None else prepare(x))
        # Two windows under the same load: CPU and throughput with no ticker running,
        # then the loop's lag with the ticker on (its own CPU is the harness's: at the
        # few requests a second of the emulated 640x640 task it would outweigh the rest).
        lags: list[float] = []
        stop = asyncio.Event()
        done = 0
        counting = True
        lag_seconds = max(1.0, seconds / 2)
        device_before = device_seconds(engine)
        before = cpu_by_thread()
        started = time.perf_counter()
        deadline = started + seconds + lag_seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                if prepare is None:
                    result = await engine.infer(x)
                else:
                    result = await engine.infer(await asyncio.to_thread(prepare, x))
                if finish is not None:
                    await asyncio.to_thread(finish, result)
                done += counting

        async def windows() -> tuple[dict[str, float], float, int]:
            nonlocal counting
            await asyncio.sleep(seconds)
            counting = False
            after = cpu_by_thread()
            after["device"] = device_seconds(engine)
            counted = done
            elapsed = time.perf_counter() - started
            tick = asyncio.ensure_future(ticker(lags, stop))
            await asyncio.sleep(lag_seconds)
            stop.set()
            await tick
            return after, elapsed, counted

        measured, *_ = await asyncio.gather(windows(), *(worker() for _ in range(16)))
        after, elapsed, done = measured
        before["device"] = device_before
    per = {key: 1e6 * (after[key] - before[key]) / max(done, 1) for key in after}
    rate = done / elapsed
    lags.sort()
    return {
        "requests": done,
        "rate": rate,
        "x_ideal": rate / (CORES / service),
        "process_us": per["process"],
        "host_us": per["process"] - per["dla"] - per["device"],
        "device_us": per["dla"] + per["device"],
        "loop_us": per["loop"],
        "poller_us": per["poller"],
        "other_us": per["other"],
        "lag_p99_ms": 1e3 * lags[int(0.99 * (len(lags) - 1))] if lags else float("nan"),
    }


def device_floor(model: bytes, runtime_name: str, seconds: float, service: float) -> float:
    """Tasks per second the runtime itself sustains for ``model`` on both cores: tasks
    submitted back to back on a ring of streams per core, with no copies, conversion or
    engine. On the emulated runtime that is ``cores / service_time``; the GPU stand-in
    runs a task as one block of threads, which for camera-sized tensors takes longer
    than the stated service time, so this, not ``cores / service_time``, is the ideal an
    engine can reach on it."""
    from aiodla import EmulatedRuntime
    from aiodla.runtime import CudaRuntime

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
    from _setup import ModelSetup  # the cuDLA calls by hand, as the GPU tests make them

    runtime: Any = CudaRuntime(0) if runtime_name == "cuda" else EmulatedRuntime()
    runtime.make_current()
    with contextlib.ExitStack() as opened:
        cores = [opened.enter_context(ModelSetup(runtime, core, model)) for core in range(CORES)]
        rings = [[runtime.create_stream() for _ in range(4)] for _ in cores]
        for ring in rings:
            for stream in ring:
                opened.callback(runtime.destroy_stream, stream)
        per_core = max(4, int(seconds / service))
        began = time.perf_counter()
        for index in range(per_core):
            for core, ring in zip(cores, rings, strict=True):
                runtime.submit_task(core.device, core.task, ring[index % len(ring)])
        for ring in rings:
            for stream in ring:
                runtime.synchronize_stream(stream)
        return CORES * per_core / (time.perf_counter() - began)


def frames(gpu: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    host32 = rng.random(FRAME.shape, dtype=np.float32)
    host8 = rng.integers(0, 256, FRAME.shape).astype(np.uint8)
    # float16: a pre-made input in the tensor's own type, the camera issue's reference.
    made: dict[str, Any] = {"float32": host32, "float16": host32.astype(np.float16), "uint8": host8}
    if gpu:
        try:
            import cupy

            made["device float32"] = cupy.asarray(host32)
            made["device uint8"] = cupy.asarray(host8)
        except ImportError:
            import torch

            made["device float32"] = torch.from_numpy(host32).cuda()
            made["device uint8"] = torch.from_numpy(host8).cuda()
    return made


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def small_input() -> np.ndarray[Any, Any]:
    """The small model's request: its input as the engine takes it."""
    return np.ones(SMALL_IN.shape, np.float16)


def camera_frame() -> np.ndarray[Any, Any]:
    """A 1920x1080 BGR frame, as OpenCV decodes a camera's."""
    return np.random.default_rng(1).integers(0, 256, (1080, 1920, 3)).astype(np.uint8)


def letterbox_options(convert: str) -> dict[str, Any]:
    """Engine options that letterbox a BGR camera frame into the model's input."""
    letterbox = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
    return {"convert": convert, "preprocess": {FRAME.name: letterbox}}


def boxes_options() -> dict[str, Any]:
    """Camera to boxes ("boxes: engine + buffers"): letterboxed on the device, ``Detect``
    on the slots' streams, with :func:`yolov5s` and the frame in a frame buffer."""
    return {**letterbox_options("device"), "postprocess": Detect(head="yolov5")}


def in_frame_buffer(engine: Engine, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``x`` copied into one of ``engine``'s frame buffers, as a camera writes it."""
    (buffer,) = engine.frame_buffers(1, x.shape, x.dtype)
    buffer[:] = x
    return buffer


def run(args: argparse.Namespace) -> dict[str, Any]:
    runtime = "cuda" if args.gpu else "emulated"
    # The GPU stand-in runs a task as one block of threads: for a 640x640 input and a
    # 255x80x80 output that takes longer than 3.8 ms, and a DLA's stated service time
    # is what its task takes. So the model states what the runtime takes (plus 10 %),
    # when that is longer: the ideal and the poller's estimates are then true.
    task_time = CORES / device_floor(detector(), runtime, args.seconds, SERVICE)
    service = SERVICE if task_time <= 1.02 * SERVICE else round(1.1 * task_time, 4)
    print(
        f"the runtime takes {1e3 * task_time:.2f} ms per 640x640 task stated as "
        f"{1e3 * SERVICE:.1f} ms: measuring at {1e3 * service:.2f} ms service",
        flush=True,
    )
    inputs = frames(args.gpu)
    cases: list[tuple[str, bytes, Any, dict[str, Any], Any]] = [
        ("small 32x32", small(service), small_input, {}, None),
    ]
    for convert in ("host", "device"):
        for name, value in inputs.items():
            if name.startswith("device") and convert == "host":
                continue  # device arrays need device conversion
            cases.append(
                (
                    f"{convert} / {name}",
                    detector(service),
                    lambda v=value: v,
                    {"convert": convert},
                    None,
                )
            )
    camera = camera_frame()
    for convert in ("host", "device"):
        cases.append(
            (
                f"{convert} / 1080p frames",
                detector(service),
                lambda: camera,
                letterbox_options(convert),
                None,
            )
        )
    try:
        import cv2

        cases.append(
            ("OpenCV host / 1080p", detector(service), lambda: camera, {}, opencv_letterbox)
        )
    except ImportError:
        print("OpenCV is not installed: no host pre-processing baseline", flush=True)
    # Camera to boxes: 1080p BGR frames -> YOLOv5s-shaped heads -> Detections.
    cases.append(
        (
            "boxes: engine + buffers",
            yolov5s(service),
            lambda: camera,
            {**boxes_options(), "frame_buffer": True},
            None,
        )
    )
    try:
        import cv2  # noqa: F401

        cases.append(
            (
                "boxes: heads + host NMS",
                yolov5s(service),
                lambda: camera,
                {**letterbox_options("device"), "finish": HostDecode(camera.shape[:2])},
                None,
            )
        )
    except ImportError:
        print("OpenCV is not installed: no host decode + NMS baseline", flush=True)
    if args.only:
        wanted = args.only.split(",")
        cases = [c for c in cases if c[0] == "small 32x32" or any(w in c[0] for w in wanted)]
    raw: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in cases}
    floors: list[float] = []
    for repeat in range(args.repeats):
        floor_rate = device_floor(detector(service), runtime, args.seconds, service)
        floors.append(floor_rate)
        print(f"[{repeat + 1}/{args.repeats}] device floor: {floor_rate:.1f} tasks/s", flush=True)
        for name, model, make_input, options, prepare in cases:  # interleaved
            engine_options = {"runtime": runtime, **options}
            result = asyncio.run(
                measure(model, make_input, args.seconds, engine_options, prepare, service)
            )
            # The 640x640 cases against what the runtime sustains for that model alone.
            tiny = name == "small 32x32"
            result["x_floor"] = result["rate"] / (CORES / service if tiny else floor_rate)
            raw[name].append(result)
            print(f"[{repeat + 1}/{args.repeats}] {name}: {result}", flush=True)
    report: dict[str, Any] = {
        "runtime": runtime,
        "service_s": service,
        "stated_service_s": SERVICE,
        "task_time_at_stated_s": task_time,
        "device_floor_per_s": summarize(floors),
        "cases": {},
    }
    floor = statistics.median(r["process_us"] for r in raw["small 32x32"])
    host_floor = statistics.median(r["host_us"] for r in raw["small 32x32"])
    for name, results in raw.items():
        keys = results[0].keys()
        entry = {key: summarize([r[key] for r in results]) for key in keys}
        entry["cpu_vs_small"] = summarize([r["process_us"] / floor for r in results])
        entry["host_vs_small"] = summarize([r["host_us"] / host_floor for r in results])
        report["cases"][name] = entry
    engine_boxes, host_boxes = (
        raw.get("boxes: engine + buffers"),
        raw.get("boxes: heads + host NMS"),
    )
    if engine_boxes and host_boxes:  # the camera-to-boxes target, repeat by repeat
        # A window that saw too few requests says nothing per request (at the emulated
        # 640x640 task's few a second): such repeats are left out, and counted.
        ratios = [
            a["host_us"] / b["host_us"]
            for a, b in zip(engine_boxes, host_boxes, strict=True)
            if min(a["requests"], b["requests"]) >= MIN_REQUESTS
        ]
        left_out = len(engine_boxes) - len(ratios)
        if ratios:
            report["boxes_host_ratio"] = {**summarize(ratios), "target": 0.5, "left_out": left_out}
    return report


def table(report: dict[str, Any]) -> str:
    floor = report["device_floor_per_s"]
    lines = [
        f"runtime {report['runtime']}, {1e3 * report['service_s']:.1f} ms service, {CORES} cores;"
        f" ideal {CORES / report['service_s']:.0f}/s; the runtime alone sustains"
        f" {floor['median']:.0f}/s ({floor['min']:.0f}..{floor['max']:.0f}) for the 640x640 model",
        f"{'case':<26}{'x ideal':>9}{'x floor':>9}{'CPU us/req':>12}{'x small':>9}{'loop':>8}"
        f"{'poller':>8}{'other':>8}{'lag p99 ms':>12}{'host us':>9}{'x small':>8}"
        f"{'device us':>10}",
    ]
    for name, entry in report["cases"].items():
        lines.append(
            f"{name:<26}{entry['x_ideal']['median']:>9.3f}{entry['x_floor']['median']:>9.3f}"
            f"{entry['process_us']['median']:>12.0f}"
            f"{entry['cpu_vs_small']['median']:>9.2f}{entry['loop_us']['median']:>8.0f}"
            f"{entry['poller_us']['median']:>8.0f}{entry['other_us']['median']:>8.0f}"
            f"{entry['lag_p99_ms']['median']:>12.2f}"
            f"{entry['host_us']['median']:>9.0f}{entry['host_vs_small']['median']:>8.2f}"
            f"{entry['device_us']['median']:>10.0f}"
        )
    ratio = report.get("boxes_host_ratio")
    if ratio is not None:
        lines.append(
            f"camera to boxes: host CPU of (a) engine + buffers / (b) heads + host NMS = "
            f"{ratio['median']:.3f} ({ratio['min']:.3f}..{ratio['max']:.3f}), target <= 0.5; "
            f"{ratio['left_out']} repeat(s) left out with fewer than {MIN_REQUESTS} requests"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", nargs="?", help="JSON path")
    parser.add_argument("--gpu", action="store_true", help="the CUDA runtime and the stand-in")
    parser.add_argument("--standin", default=os.environ.get("AIODLA_STANDIN_LIB"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument(
        "--only",
        help="comma-separated substrings: run only the cases whose names hold one "
        "(the small model always runs: it is the CPU reference)",
    )
    args = parser.parse_args(argv)
    if args.gpu:
        load_standin(args.standin)
    report = run(args)
    kind = "gpu" if args.gpu else "emulated"
    output = report_path(args.output, f"data-path-{kind}.json")
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
