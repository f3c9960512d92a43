"""The performance page and its figures, written from ``benchmarks/results/*.json``.

Every number on the page is read from a result file at build time (the MkDocs hook in
``docs/hooks.py`` calls :func:`build`), so the text and the figures cannot drift from
the measurements. To regenerate the page and its PNGs by hand::

    python docs/gen_performance.py --out /tmp/performance

A result file this page reads that is missing or changed in shape fails the build with
its name, rather than leaving a stale figure.
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

H200 = "NVIDIA H200 running aiodla's cuDLA stand-in (real `cuda.bindings` calls, no DLA)"
DEV = "the 2-CPU development virtual machine, emulated runtime"


@dataclass
class Page:
    markdown: str
    figures: dict[str, bytes] = field(default_factory=dict)


class Results:
    """The result files, read once each, with errors that name the file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._cache: dict[str, Any] = {}

    def __call__(self, name: str) -> Any:
        if name not in self._cache:
            path = self.directory / name
            try:
                self._cache[name] = json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise SystemExit(f"gen_performance: {path} is missing") from None
        return self._cache[name]

    def names(self, pattern: str) -> list[str]:
        return sorted(path.name for path in self.directory.glob(pattern))


def med(entry: Any) -> float:
    """A summary's median, or the number itself."""
    return float(entry["median"] if isinstance(entry, dict) else entry)


def spread(entry: dict[str, float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(entry['median'])} [{fmt.format(entry['min'])}..{fmt.format(entry['max'])}]"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def figure(draw: Callable[[Any], None], width: float = 7.0, height: float = 3.2) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    try:
        draw(ax)
        fig.tight_layout()
        out = io.BytesIO()
        # No timestamp in the file, so an unchanged result gives an unchanged PNG.
        fig.savefig(out, format="png", metadata={"Software": None})
        return out.getvalue()
    finally:
        plt.close(fig)


def headline(r: Results) -> str:
    gpu = r("gpu-nvidia-h200.json")["summary"]["throughput"]
    emu = r("engine-emulated.json")
    aiodla8 = med(emu["throughput"]["aiodla c=8"])
    seed = med(emu["throughput"]["seed loop (1 core, sync)"])
    threaded = med(emu["throughput"]["to_thread, 1 thread/core, c=8"])
    ceiling = r("standin-ceiling-h200.json")["results"]["100 us"]["x_ideal"]
    iso = r("isolation-gpu.json")
    data = r("data-path-gpu-camera.json")["cases"]
    opencv = med(data["OpenCV host / 1080p"]["process_us"])
    fused = med(data["device / 1080p frames"]["process_us"])
    rows = [
        [
            "both cores busy, 1 ms tasks",
            f"{med(gpu['1000us']['aiodla_over_ideal']):.3f} x ideal",
            "H200 stand-in",
        ],
        [
            "100 us tasks (the stand-in's own ceiling)",
            f"{med(gpu['100us']['aiodla_over_ideal']):.3f} x ideal ({med(ceiling):.3f})",
            "H200 stand-in",
        ],
        [
            "against NVIDIA's one-request loop / a thread per core, 1 ms",
            f"{aiodla8 / seed:.1f} x / {aiodla8 / threaded:.1f} x",
            "emulated, 2-CPU VM",
        ],
        [
            "1080p camera frames: pre-processing on the GPU against OpenCV on the host",
            f"{opencv / fused:.1f} x less CPU a frame",
            "H200 stand-in",
        ],
        [
            '`isolation="process"`: throughput / recovery from a lost CUDA context',
            f"{iso['modes']['process']['of_ideal'] / iso['modes']['thread']['of_ideal']:.3f} x "
            f"thread mode / {iso['recovery_ms']['median'] / 1000:.2f} s",
            "H200 stand-in",
        ],
    ]
    return table(["what", "measured", "where"], rows)


def throughput_section(r: Results, figures: dict[str, bytes] | None) -> str:
    runs = [r("gpu-nvidia-h200.json"), r("gpu-nvidia-h200-repeat.json")]
    cfg = runs[0]["config"]
    rows = []
    for label, key in (("1 ms service", "1000us"), ("100 us service", "100us")):
        cells = [label]
        for run in runs:
            t = run["summary"]["throughput"][key]
            ideal = t["ideal"]
            cells.append(
                f"{spread(t['aiodla_over_ideal'])} / {med(t['seed']) / ideal:.2f} / "
                f"{med(t['threaded']) / ideal:.2f}"
            )
        rows.append(cells)
    light = [run["summary"]["light"] for run in runs]
    rows.append(
        ["added latency at light load (1 ms tasks), p50"]
        + [
            f"{med(x['aiodla']['p50']) * 1e6:.0f} us "
            f"({x['aiodla_p50_over_poll']:.2f} x a busy-poll thread)"
            for x in light
        ]
    )

    def draw(ax: Any) -> None:
        keys = ["1000us", "100us"]
        series = [
            ("aiodla", "aiodla"),
            ("seed", "seed loop"),
            ("threaded", "asyncio + thread per core"),
        ]
        width = 0.25
        for i, (key, label) in enumerate(series):
            values = [
                med(runs[0]["summary"]["throughput"][k][key])
                / runs[0]["summary"]["throughput"][k]["ideal"]
                for k in keys
            ]
            ax.bar([j + i * width for j in range(len(keys))], values, width, label=label)
        ax.set_xticks([j + width for j in range(len(keys))], ["1 ms tasks", "100 us tasks"])
        ax.set_ylabel("x ideal (cores / service time)")
        ax.set_ylim(0, 1.05)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.legend(fontsize=8, loc="lower left")
        ax.set_title("Throughput against the ideal, H200 stand-in", fontsize=10)

    if figures is not None:
        figures["throughput.png"] = figure(draw)
    return "\n\n".join(
        [
            f"`python benchmarks/bench_gpu.py` on an {H200}; {cfg['streams_per_core']} streams a "
            f"core, concurrency {cfg['concurrency']}, {cfg['repeats']} repeats a run, two runs "
            "(`gpu-nvidia-h200.json`, `gpu-nvidia-h200-repeat.json`). Each cell: aiodla x ideal, "
            "median [min..max] / NVIDIA's one-request seed loop / asyncio with a thread per core "
            "over that loop.",
            table(["", "run 1", "run 2"], rows),
            "![Throughput against the ideal](performance/throughput.png)",
        ]
    )


THREAD_CASES = [
    ("0 us saturated", "zero service"),
    ("100 us saturated", "100 us, saturated"),
    ("100 us half", "100 us, half load"),
    ("1000 us saturated", "1 ms, saturated"),
    ("3800 us saturated", "3.8 ms, saturated"),
]


def threads_section(r: Results, figures: dict[str, bytes] | None) -> str:
    s = r("threads-compare-cuda-handoff.json")["summary"]
    rows = []
    for key, label in THREAD_CASES:
        case = s[key]
        x = case["x_ideal"]["base"]
        rows.append(
            [
                label,
                f"{med(case['loop_us']['base']):.1f}",
                f"{med(case['poller_us']['base']):.1f}",
                spread(case["host_us"]["base"], "{:.1f}"),
                "" if x["median"] != x["median"] else f"{med(x):.3f}",
            ]
        )
    ratios = s["base ratios"]

    def draw(ax: Any) -> None:
        labels = [label for _, label in THREAD_CASES]
        loop = [med(s[k]["loop_us"]["base"]) for k, _ in THREAD_CASES]
        poller = [med(s[k]["poller_us"]["base"]) for k, _ in THREAD_CASES]
        rest = [
            max(med(s[k]["host_us"]["base"]) - lo - po, 0.0)
            for (k, _), lo, po in zip(THREAD_CASES, loop, poller, strict=True)
        ]
        ax.bar(labels, loop, label="event loop")
        ax.bar(labels, poller, bottom=loop, label="poller")
        ax.bar(
            labels,
            rest,
            bottom=[a + b for a, b in zip(loop, poller, strict=True)],
            label="other threads",
        )
        ax.set_ylabel("host CPU a request (us)")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(fontsize=8)
        ax.set_title("Host CPU per request by thread, H200 stand-in", fontsize=10)

    if figures is not None:
        figures["threads.png"] = figure(draw)
    return "\n\n".join(
        [
            "`python benchmarks/bench_threads.py --runtime cuda` measures this; the figures are "
            "the base side of the last interleaved comparison on the H200 stand-in, the hot "
            "path as it ships, 2 cores, 8 streams a core (`python benchmarks/compare_threads.py "
            "--runtime cuda --base TREE --new . --rounds 5 --seconds 1`, "
            "`threads-compare-cuda-handoff.json`, 5 rounds, medians; its other side, a native "
            "submitter thread, was removed: it paid at zero service time only).",
            table(["2 cores", "loop us", "poller us", "host us [min..max]", "x ideal"], rows),
            f"Host CPU at 1 ms is {spread(ratios['1000 us / 0 us'], '{:.2f}')} x the zero-service "
            f"cost and at 3.8 ms {spread(ratios['3800 us / 0 us'], '{:.2f}')} x; light-load p50 is "
            f"{spread(ratios['light p50 / floor'], '{:.2f}')} x a busy-poll thread's floor.",
            "![Host CPU per request by thread](performance/threads.png)",
        ]
    )


def ceiling_section(r: Results) -> str:
    c = r("standin-ceiling-h200.json")["results"]
    chain = r("standin-ceiling-h100-event-chain.json")["results"]
    tickets = r("standin-ceiling-h100.json")["results"]
    own = r("gpu-h100-tickets-4c2a2c6.json")["summary"]["throughput"]
    return (
        "Why about 0.87 x at 100 us was the stand-in's limit, not the host's: "
        "`python benchmarks/bench_standin_ceiling.py` feeds both cores ahead of time with no "
        f"host in the way and reached {spread(c['100 us']['x_ideal'])} x ideal at 100 us and "
        f"{spread(c['1000 us']['x_ideal'])} at 1 ms (`standin-ceiling-h200.json`): each stand-in "
        f"task spent {c['100 us']['gap_us_per_task']:.0f} us of GPU time waiting on the core's "
        "previous task through a CUDA event, which a DLA does not. The stand-in now hands a "
        "core over by ticket on the GPU and keeps each core's timeline as the emulated runtime "
        "does; on an H100, both stand-ins built and measured in one run (`--repeats 3`): "
        f"event chain {spread(chain['100 us']['x_ideal'])} x ideal at 100 us "
        f"({chain['100 us']['gap_us_per_task']:.1f} us a task beyond the service), tickets "
        f"{spread(tickets['100 us']['x_ideal'])} "
        f"({tickets['100 us']['gap_us_per_task']:.1f} us); at 1 ms "
        f"{spread(chain['1000 us']['x_ideal'])} against {spread(tickets['1000 us']['x_ideal'])} "
        "(`standin-ceiling-h100-event-chain.json`, `standin-ceiling-h100.json`). The aiodla "
        "figures above were taken on the event-chain stand-in. On the ticket stand-in, on an "
        "H100 at commit 4c2a2c6 (`python benchmarks/bench_gpu.py OUT.json --repeats 2 "
        "--seconds 0.3 --requests 50`, `gpu-h100-tickets-4c2a2c6.json`), aiodla reached "
        f"{spread(own['100us']['aiodla_over_ideal'])} x ideal at 100 us and "
        f"{spread(own['1000us']['aiodla_over_ideal'])} at 1 ms, with "
        f"{med(own['100us']['loop_cpu']) * 1e6:.0f} us of the event loop's CPU a request at "
        "100 us: there the host, not the stand-in, is the limit."
    )


DATA_CASES = [
    ("small 32x32", "1x3x32x32 model (the CPU reference)"),
    ("host / float32", "host conversion, float32 frames"),
    ("device / float32", "device conversion, float32 frames"),
    ("device / device float32", "device conversion, CuPy float32 arrays"),
    ("device / 1080p frames", "1920x1080 BGR, pre-processed on the GPU"),
    ("OpenCV host / 1080p", "the same frames, OpenCV letterbox on the host"),
]


def data_path_section(r: Results, figures: dict[str, bytes] | None) -> str:
    d = r("data-path-gpu.json")
    cases = d["cases"]
    rows = [
        [
            label,
            f"{med(cases[key]['x_ideal']):.3f}",
            f"{med(cases[key]['process_us']):.0f}",
            f"{med(cases[key]['lag_p99_ms']):.2f}",
        ]
        for key, label in DATA_CASES
    ]

    def draw(ax: Any) -> None:
        labels = [label for _, label in DATA_CASES]
        values = [med(cases[key]["process_us"]) for key, _ in DATA_CASES]
        ax.barh(labels[::-1], values[::-1], color="tab:green")
        ax.set_xscale("log")
        ax.set_xlabel("host CPU a request (us, log scale)")
        ax.tick_params(axis="y", labelsize=8)
        ax.set_title("640x640 FP16 CHW16 in, 255x80x80 out: CPU per request", fontsize=10)

    if figures is not None:
        figures["data_path.png"] = figure(draw, height=3.4)
    return "\n\n".join(
        [
            "`python benchmarks/bench_data_path.py --gpu` on the H200 stand-in, both cores, 16 "
            "callers, 3 interleaved repeats, medians (`data-path-gpu.json`). The stand-in takes "
            f"{d['task_time_at_stated_s'] * 1e3:.1f} ms for a task stated at "
            f"{d['stated_service_s'] * 1e3:.1f} ms, so the benchmark measures against "
            f"`cores / {d['service_s'] * 1e3:.1f} ms`.",
            table(["case", "x ideal", "CPU per request (us)", "event-loop lag p99 (ms)"], rows),
            "![CPU per request on the data path](performance/data_path.png)",
        ]
    )


BOXES_CASES = (
    ("small 32x32", "(c) small 32x32 model, the CPU reference"),
    ("boxes: engine + buffers", "(a) Detect on the slot's stream, frame buffers"),
    ("boxes: heads + host NMS", "(b) raw heads, numpy decode, OpenCV NMS"),
)


def boxes_rows(cases: dict[str, Any]) -> list[list[str]]:
    """The camera-to-boxes table's rows, from a GPU run of ``bench_data_path``."""
    return [
        [
            label,
            spread(cases[key]["x_ideal"]),
            f"{med(cases[key]['host_us']):.0f}",
            f"{med(cases[key]['host_vs_small']):.2f}",
            f"{med(cases[key]['lag_p99_ms']):.2f}",
        ]
        for key, label in BOXES_CASES
    ]


def boxes_section(r: Results) -> str:
    d = r("data-path-gpu-boxes.json")
    rows = boxes_rows(d["cases"])
    ratio = d["boxes_host_ratio"]
    h = r("data-path-h100-boxes.json")
    h100_rows = boxes_rows(h["cases"])
    e = r("data-path-emulated-boxes.json")
    emulated_rows = [
        [
            label,
            spread(e["cases"][key]["host_us"], "{:.0f}"),
        ]
        for key, label in BOXES_CASES
    ]
    emulated_ratio = e["boxes_host_ratio"]
    k = r("detect-kernels-h200.json")
    kernel_rows = [
        [
            name,
            f"{med(case['kernels_us']):.1f}",
            f"{med(case['copy_us']):.1f}",
            str(case["kept"]),
        ]
        for name, case in k["cases"].items()
    ]
    return "\n\n".join(
        [
            "1920x1080 BGR frames into YOLOv5s-shaped heads and `Detections`, both cores of "
            "the H200 stand-in: `python benchmarks/bench_data_path.py OUT.json --gpu --only "
            "boxes --repeats 3 --seconds 1.5`, 3 interleaved repeats, medians "
            f"(`data-path-gpu-boxes.json`). The stand-in takes "
            f"{d['task_time_at_stated_s'] * 1e3:.1f} ms for a task stated at "
            f"{d['stated_service_s'] * 1e3:.1f} ms.",
            table(["case", "x ideal", "host CPU a frame (us)", "x (c)", "lag p99 (ms)"], rows),
            f"Host CPU of (a) against (b): {spread(ratio)} (target at most {ratio['target']}).",
            "Taken again after a step moves to a worker thread only when it copies more than "
            "`offload_bytes` (a frame read in place from a frame buffer is staged on the "
            "loop), with the same command on an H100 of the GPU machine "
            f"(`data-path-h100-boxes.json`; a task stated at {h['stated_service_s'] * 1e3:.1f} "
            f"ms took {h['task_time_at_stated_s'] * 1e3:.1f} ms there). The figures of the "
            "two cards are of different machines, so compare each row with its own (c):",
            table(["case", "x ideal", "host CPU a frame (us)", "x (c)", "lag p99 (ms)"], h100_rows),
            f"Host CPU of (a) against (b) on the H100: {spread(h['boxes_host_ratio'])}.",
            "On the emulated runtime, on the 2-CPU development machine (the first two repeats "
            "quiet, the last three beside other work: load 16): `python "
            "benchmarks/bench_data_path.py OUT.json --only boxes --repeats 5 --seconds 10`, 5 "
            "interleaved repeats (`data-path-emulated-boxes.json`). The emulator computes a "
            f"640x640 task in about {e['task_time_at_stated_s'] * 1e3:.0f} ms of CPU; the "
            "host figure is the process's CPU less the emulated device's work (its stream "
            "operations and the task's arithmetic, which a Jetson's DLA and GPU do). In (a) "
            "that includes the decode and NMS, a stream operation after the task as on the "
            "GPU; in (b) they are the host's, in a worker thread.",
            table(["case", "host CPU a frame (us)"], emulated_rows),
            f"Host CPU of (a) against (b) on the emulated runtime: {spread(emulated_ratio)} "
            f"(the issue's target at most {emulated_ratio['target']}).",
            "The post-processing kernels (decode, rank, IoU bitmask, greedy pass, "
            "compaction) against a device-to-device copy of the heads' bytes, median of "
            f"{k['rounds']}: `python benchmarks/bench_detect_kernels.py --json OUT.json` "
            f"(`detect-kernels-h200.json`, target at most {k['target_us']:.0f} us for "
            "YOLOv5s' heads).",
            table(["heads", "kernels (us)", "copy of the heads (us)", "boxes kept"], kernel_rows),
        ]
    )


def isolation_section(r: Results) -> str:
    d = r("isolation-gpu.json")
    t, p = d["modes"]["thread"], d["modes"]["process"]
    rows = [
        ["x ideal, 1 ms tasks on both cores", f"{t['of_ideal']:.3f}", f"{p['of_ideal']:.3f}"],
        [
            "p50 latency added over the service time (us)",
            f"{t['p50_added_us']:.0f}",
            f"{p['p50_added_us']:.0f}",
        ],
        [
            "fault to the first request served anew",
            "none: the engine is dead",
            f"{d['recovery_ms']['median']:.0f} ms median, {d['recovery_ms']['max']:.0f} max "
            f"over {len(d['recovery_ms']['all'])} faults",
        ],
    ]
    diff = d["added_latency_difference_us"]
    return "\n\n".join(
        [
            "`python benchmarks/bench_isolation.py --runtime cuda --repeats 7 --seconds 1.5 "
            "--faults 20` on the H200 stand-in (`isolation-gpu.json`), the modes interleaved.",
            table(["", '`isolation="thread"`', '`isolation="process"`'], rows),
            f"Process mode adds {diff['median']:.0f} us at p50 (per repeat "
            f"{diff['min']:.0f} to {diff['max']:.0f} us).",
        ]
    )


def serve_section(r: Results) -> str:
    d = r("serve-emulated.json")
    res = d["results"]
    rows = [
        [
            name,
            f"{med(res[key]['rps']):.0f}",
            f"{med(res[key]['p50_ms']):.1f}",
            f"{med(res[key]['p99_ms']):.1f}",
        ]
        for key, name in (("direct", "`Engine.infer`"), ("http", "HTTP"), ("grpc", "gRPC"))
    ]
    return "\n\n".join(
        [
            f"`python benchmarks/bench_serve.py`: emulated 1x3x32x32 model, 1 ms service, both "
            f"cores, {d['concurrency']} requests in flight, Triton's asyncio clients, on {DEV} "
            f"shared by client, server and emulator; medians of {d['repeats']} interleaved runs "
            "(`serve-emulated.json`).",
            table(["path", "requests/s", "p50 ms", "p99 ms"], rows),
        ]
    )


def trace_section(r: Results) -> str:
    d = r("trace-emulated.json")
    p = d["parameters"]
    modes, ratios = d["modes"], d["ratios"]
    labels = {"base": "no hooks (the tree before them)", "off": "hooks, no trace", "on": "tracing"}
    rows = [
        [labels[mode], spread(m["loop_us"], "{:.1f}"), spread(m["process_us"], "{:.1f}")]
        for mode, m in modes.items()
    ]
    cost = [
        [name, spread(ratio["loop_us"]), spread(ratio["process_us"])]
        for name, ratio in ratios.items()
    ]
    return "\n\n".join(
        [
            f"`python benchmarks/bench_trace.py --base TREE --rounds {p['rounds']} --requests "
            f"{p['requests']}` ({DEV}; zero service time, {p['concurrency']} requests in flight "
            f"over 2 cores x 4 streams; `trace-emulated.json`): host CPU a request, medians of "
            f"{p['rounds']} interleaved rounds [min..max], each mode in a fresh process.",
            table(["", "event loop us", "process us"], rows),
            "Ratios within each round, median [min..max]:",
            table(["", "event loop", "process"], cost),
            "At zero service time the host's cost is all there is; at a real DLA task's "
            "millisecond the same microseconds are a smaller share.",
            trace_instructions(r),
        ]
    )


# The bounds issue 32 set on tracing's host cost per request.
TRACE_BOUNDS = {"off / bare": 1.02, "on / bare": 1.15}


def _against(ratio: dict[str, float], bound: float | None) -> list[str]:
    """A ratio's bound, and whether every round, or only the median, is within it."""
    if bound is None:
        return ["", ""]
    if ratio["max"] <= bound:
        verdict = "met by every round"
    elif ratio["median"] <= bound:
        verdict = f"met by the median; a round reached {ratio['max']:.4f}"
    else:
        verdict = "NOT met"
    return [f"<= {bound:.2f}", verdict]


def trace_instructions(r: Results) -> str:
    """The same cost counted in instructions (callgrind), which a loaded machine does
    not move, against the bounds."""
    d = r("trace-instructions.json")
    p = d["parameters"]
    labels = {
        "bare": "no hooks (this tree, the hooks taken out)",
        "base": f"the tree before the hooks ({p.get('base_commit') or 'base'})",
        "off": "hooks, no trace",
        "on": "tracing",
    }
    counts = d["loop_instructions_per_request"]
    rows = [[labels[m], spread(c, "{:,.0f}")] for m, c in counts.items()]
    ratios = []
    for name, ratio in d["ratios"].items():
        bound = TRACE_BOUNDS.get(name)
        ratios.append([name, spread(ratio, "{:.4f}"), *_against(ratio, bound)])
    return "\n\n".join(
        [
            f"`python benchmarks/bench_trace.py --without-hooks --instructions --delta "
            f"{p['requests_a_segment']} --segments {p['segments']} --warmup {p['warmup']} "
            f"--rounds {p['rounds']}` (`trace-instructions.json`): the event loop thread's "
            "instructions a request under callgrind, each run's segments measured apart from "
            f"start-up, {p['rounds']} interleaved rounds, median [min..max] over every "
            f"segment (Python {p['python']}).",
            table(["", "loop instructions a request"], rows),
            "Ratios within each round, median [min..max], against the bounds:",
            table(["", "ratio", "bound", ""], ratios),
        ]
    )


def small_section(r: Results) -> str:
    lay = r("layouts.json")["target"]["verdict"]
    soak = r("soak.json")
    emu = r("engine-emulated.json")
    return "\n".join(
        [
            f"- `python benchmarks/bench_engine.py` ({DEV}, `engine-emulated.json`): "
            f"{med(emu['throughput']['aiodla c=8']) / emu['ideal']:.3f} x ideal at "
            "concurrency 8; host CPU a request at zero service "
            f"{med(emu['host_cost']['host_us']):.0f} us.",
            f"- `python benchmarks/bench_layouts.py` (`layouts.json`): packing a 1x3x640x640 "
            f"float32 array into FP16 CHW16 costs "
            f"{lay['pack (BoundTensor.write)']['ratio_to_copy']:.2f} x a copy of the same bytes, "
            f"unpacking {lay['unpack (BoundTensor.read)']['ratio_to_copy']:.2f} x.",
            f"- `python benchmarks/soak.py` (`soak.json`): {soak['requests']:,} requests with "
            f"cancellations and timeouts; resident memory grew {soak['rss_growth'] * 100:.1f} %, "
            f"counts add up: {soak['counts_add_up']}, handles left after close: "
            f"{sum(soak['live_handles_after_close'].values())}.",
        ]
    )


# What each recorded comparison held against what; the figures come from the files.
HISTORY = {
    "threads-compare-cuda.json": (
        "the hot path's rework (graphs, estimates, GIL kept in the calls) against the release "
        "before"
    ),
    "threads-compare-cuda-3b524cc.json": "an intermediate tree of that rework (3b524cc)",
    "threads-compare-cuda-2f6a4f1.json": "an intermediate tree of that rework (2f6a4f1)",
    "threads-compare-cuda-unheld.json": "calls keeping the GIL, alone (`hold_gil=False` as base)",
    "threads-compare-cuda-numpycopy.json": "small copies keeping the GIL, alone",
    "threads-compare-cuda-handoff.json": (
        "a native submitter thread (removed), alone (off as base)"
    ),
    "threads-compare-cuda-handoff-vs-a114385.json": (
        "the submitter thread's tree (removed) against the commit before it"
    ),
    "threads-compare-cuda-handoff-always.json": "a first submitter thread that took every request",
    "threads-compare-cuda-handoff-always-vs-a114385.json": (
        "that first submitter thread against the commit before it"
    ),
    "threads-compare-cuda-handoff-fed.json": "a submitter thread decided by the core's queue alone",
    "threads-compare-emulated.json": "emulated runtime: the rework against the release before",
    "threads-compare-emulated-7ab01e3.json": (
        "emulated runtime: GIL-keeping changes (not on its path)"
    ),
    "threads-compare-emulated-handoff.json": "emulated: the submitter thread's tree (removed)",
}


def history_section(r: Results) -> str:
    rows = []
    for name in r.names("threads-compare-*.json"):
        summary = r(name)["summary"]

        def pair(case: str, key: str, fmt: str, s: Any = summary) -> str:
            entry = s[case][key]
            return f"{fmt.format(med(entry['base']))} → {fmt.format(med(entry['new']))}"

        rows.append(
            [
                f"`{name}`",
                HISTORY.get(name, r(name)["revisions"]["new"]),
                pair("0 us saturated", "host_us", "{:.1f}"),
                pair("100 us saturated", "x_ideal", "{:.3f}"),
                pair("1000 us saturated", "host_us", "{:.1f}"),
            ]
        )
    return "\n\n".join(
        [
            "Each row is one `benchmarks/compare_threads.py` call, two trees interleaved in one "
            "run (base → new, medians). The machines moved between calls: the same tree measured "
            "39 to 60 us a request at zero service on different days, so compare within a row, "
            "not across rows.",
            table(
                [
                    "result",
                    "comparison",
                    "host us, zero service",
                    "x ideal, 100 us",
                    "host us, 1 ms",
                ],
                rows,
            ),
            "What the history taught, in short:",
            "\n".join(
                [
                    "- At 100 us tasks the event loop's thread is the scarce resource; a ring "
                    "deeper than the default 2 streams a core (4 or 8) keeps the DLA fed.",
                    "- A poller that woke the loop for every other task cost more than the "
                    "work; the cores' estimates now follow the poller's evidence and the loop "
                    "harvests completions itself after each batch.",
                    "- Each `cuda.bindings` call that released the GIL handed it to the poller "
                    "and back; the hot path's short calls now keep it.",
                    "- A Python submitter thread lost to the loop (each release and retake of "
                    "the GIL costs more than the overlap gains, `bench_submitter_thread.py`); a "
                    "C thread built with the host's compiler paid off at zero service time only "
                    "(no model has it) and was removed.",
                ]
            ),
        ]
    )


def instructions_section(r: Results) -> str:
    rows = []
    for name in r.names("instructions-*.json"):
        d = r(name)
        if "trees" not in d:  # one tree, N and N + DELTA requests, the device's work in
            rows.append(
                [
                    f"`{name}`",
                    "",
                    f"{d['loop_instructions_per_request']:,.0f}",
                    f"{d['other_threads_instructions_per_request']:,.0f}",
                ]
            )
            continue
        for tree in d["trees"]:
            loop = tree["loop_instructions_per_request"]
            rows.append(
                [
                    f"`{name}`",
                    tree.get("revision", tree["tree"]),
                    f"{loop['median']:,.0f} ({loop['min']:,.0f}..{loop['max']:,.0f})",
                    f"{med(tree['other_threads_instructions_per_request']):,.0f}",
                ]
            )
    return "\n\n".join(
        [
            "CPU times on the shared 2-CPU machine move by tens of percent with its load, so "
            "trees are compared by instructions counted with callgrind (`python "
            "benchmarks/count_instructions.py --tree PATH --tree PATH`: the emulated "
            "runtime, zero-latency cores, 64 requests in flight; segments of one process "
            "after a warm-up, the trees interleaved, median (min..max) over the segments). "
            "Files with one tree per file were counted the earlier way (two processes, N "
            "and N + DELTA requests) with the emulated device's work (its copies and the "
            "op) in the counts: whichever thread looked at an event first did it, which "
            "moved their figures by up to 20 % from run to run.",
            table(
                ["result", "tree", "event loop a request", "other threads"],
                rows,
            ),
        ]
    )


def every_result(r: Results) -> str:
    """Each file under benchmarks/results, so nothing recorded is out of sight."""
    rows = []
    for name in r.names("*.json"):
        d = r(name)
        keys = ", ".join(f"`{k}`" for k in list(d)[:4]) if isinstance(d, dict) else ""
        rows.append([f"`{name}`", keys])
    return "\n\n".join(
        [
            "Every result file this page was built from (the first keys of each):",
            table(["file", "holds"], rows),
        ]
    )


def build(directory: Path = RESULTS, *, draw: bool = True) -> Page:
    """The page from the results in ``directory``; ``draw=False`` leaves the figures out
    (matplotlib takes most of the time)."""
    r = Results(directory)
    figures: dict[str, bytes] | None = {} if draw else None
    sections = [
        "# Performance",
        '!!! note "Where these were measured"\n'
        "    No Jetson was measured. The figures come from an NVIDIA H200 running aiodla's "
        "cuDLA stand-in (a test double of `libcudla.so.1` whose DLA tasks are GPU kernels) "
        "through the real `cuda.bindings` calls, and from the emulated runtime on a 2-CPU "
        "development virtual machine. A DLA's task times, Orin's CPU and NVIDIA's own "
        "`libcudla.so.1` may move every figure.",
        "This page is generated from `benchmarks/results/*.json` by `docs/gen_performance.py` "
        "at each build of the site; `python docs/gen_performance.py --out DIR` writes it and "
        "its figures by hand.",
        "## At a glance",
        headline(r),
        "## Throughput against the ideal",
        throughput_section(r, figures),
        ceiling_section(r),
        "## Host CPU per request, by thread",
        threads_section(r, figures),
        "## The GPU data path and camera frames",
        data_path_section(r, figures),
        "## Camera to boxes",
        boxes_section(r),
        "## Process isolation",
        isolation_section(r),
        "## Serving over the network",
        serve_section(r),
        "## Tracing",
        trace_section(r),
        "## Smaller measurements",
        small_section(r),
        "## Instructions per request",
        instructions_section(r),
        "## Run-by-run history",
        history_section(r),
        "## Every result",
        every_result(r),
    ]
    return Page("\n\n".join(sections) + "\n", figures or {})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON results' folder")
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for performance.md and its PNGs"
    )
    args = parser.parse_args(argv)
    page = build(args.results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "performance.md").write_text(page.markdown, encoding="utf-8")
    (args.out / "performance").mkdir(exist_ok=True)
    for name, data in page.figures.items():
        (args.out / "performance" / name).write_bytes(data)
    print(f"wrote {args.out / 'performance.md'} and {len(page.figures)} figures")


if __name__ == "__main__":
    main()
