"""Camera fan-out: cameras in (files or RTSP), one detector, boxes per frame.

    python examples/camera_fanout.py                              # its own clips, served
    python examples/camera_fanout.py rtsp://cam1/s rtsp://cam2/s --model yolov5s.bin
    python examples/camera_fanout.py a.mp4 b.mkv --save out/      # an annotated video each
    python examples/camera_fanout.py --trace run.json             # and the engine's timeline

Each camera is an ``aiodla.VideoSource``: decoded on a thread of its own (FFmpeg on the
CPU here; NVDEC or a Jetson's decoder where ``decoder="auto"`` finds them), each frame
written straight into one of the engine's frame buffers, reconnecting if the camera
drops. Each feeds its own ``aiodla.LatestFrameStream``: at most one frame in flight and
one waiting, a newer frame replacing the waiting one (counted as dropped). The engine
letterboxes each frame to the detector's 640x640 input from the decoder's own YUV
(``ImagePreprocess``), runs it, decodes the heads and runs NMS (``Detect``), and
answers with ``Detections`` in the frame's own pixels.

With no URI it encodes its own clips (PyAV) and serves them over RTSP with GStreamer's
gst-rtsp-server when that is installed (Debian: ``gir1.2-gst-rtsp-server-1.0``), else
reads the clips as files at their frame rate. Without --model it builds the YOLOv5s
emulator loadable (``aiodla emulate --preset yolov5s``): raw heads with a few dozen
objects a frame.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from aiodla import (
    Detect,
    Detections,
    Engine,
    ImagePreprocess,
    LatestFrameStream,
    StreamStatistics,
    TensorSpec,
    VideoFrame,
    VideoSource,
)
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS
from aiodla.testing import RtspServer, encode_clip
from aiodla.testing._video import rtsp_server_python

CLIP_SIZE = (640, 360)  # the clips this example makes (width, height)


def demo_model(latency: float, size: int = 640) -> bytes:
    """YOLOv5s' I/O (``aiodla emulate --preset yolov5s``), or the same at a ``size`` x
    ``size`` input (heads of size/8, size/16, size/32)."""
    inputs, outputs, _ = PRESETS["yolov5s"]
    if size != 640:
        inputs = (TensorSpec("images", (1, 3, size, size), "float16", "chw16"),)
        outputs = tuple(
            TensorSpec(s.name, (1, 255, size // k, size // k), "float16", "chw16")
            for s, k in zip(outputs, (8, 16, 32), strict=True)
        )
    return make_loadable(inputs, outputs, "detect", latency)


@contextlib.contextmanager
def own_cameras(count: int, size: tuple[int, int], seconds: float, workdir: Path) -> Any:
    """``count`` cameras of this example's own: URIs of clips served over RTSP, or the
    clip files themselves where no RTSP server can run here."""
    clips = [
        encode_clip(workdir / f"cam{i}.mkv", "h264" if i % 2 == 0 else "h265",
                    frames=int(30 * (seconds + 3)), size=size)
        for i in range(count)
    ]  # fmt: skip
    if rtsp_server_python() is None:
        yield [str(clip) for clip in clips]
        return
    codecs = ["h264" if i % 2 == 0 else "h265" for i in range(count)]
    with RtspServer({f"cam{i}": (clip, codecs[i]) for i, clip in enumerate(clips)}) as server:
        yield [server.url(f"cam{i}") for i in range(count)]


class Recorder:
    """An annotated video of one camera: each answered frame, its boxes drawn (PyAV)."""

    def __init__(self, path: Path, width: int, height: int) -> None:
        import av

        self.path = path
        self.container: Any = av.open(str(path), "w")
        self.stream = self.container.add_stream("libx264", rate=30)
        self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, "yuv420p"
        self.frames = 0

    def add(self, frame: VideoFrame, detections: Detections) -> None:
        import av
        import cv2  # opencv-python-headless

        code = cv2.COLOR_YUV2BGR_I420 if frame.format == "i420" else cv2.COLOR_YUV2BGR_NV12
        image = cv2.cvtColor(np.asarray(frame.array), code)
        draw(image, detections)
        picture = av.VideoFrame.from_ndarray(image.astype(np.uint8, copy=False), format="bgr24")
        for packet in self.stream.encode(picture):
            self.container.mux(packet)
        self.frames += 1

    def close(self) -> None:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()


def draw(image: np.ndarray[Any, Any], detections: Detections) -> None:
    import cv2

    for box, score, cls in detections:
        x1, y1, x2, y2 = (round(float(v)) for v in box)
        cv2.rectangle(image, (x1, y1), (x2, y2), (0, 255, 0), 2)
        cv2.putText(
            image, f"{cls}:{score:.2f}", (x1, max(y1 - 4, 10)), cv2.FONT_HERSHEY_SIMPLEX,
            0.5, (0, 255, 0), 1,
        )  # fmt: skip


async def camera(
    source: VideoSource,
    stream: LatestFrameStream,
    duration: float,
    save: Path | None,
    paced: bool,
) -> tuple[int, list[float]]:
    """Feed the source's frames to its stream for ``duration`` seconds (a file's at its
    own frame rate when ``paced``); the boxes found and each answered frame's
    capture-to-boxes seconds."""
    boxes, latencies = 0, []
    recorder: Recorder | None = None
    last_offered: int | None
    newest_answer, last_offered = -1, None  # the feed's end waits for its last frame
    answered = asyncio.Event()

    async def read() -> None:
        nonlocal boxes, recorder, newest_answer
        async for result in stream:  # answers arrive in frame order
            newest_answer = result.index
            if last_offered is not None and newest_answer >= last_offered:
                answered.set()
            if result.error is not None:  # a failed frame has an error and no output
                continue
            frame: VideoFrame = result.context
            latencies.append(time.time() - frame.captured_at)
            detections: Detections = result.output
            boxes += len(detections)
            if save is not None:
                if recorder is None:
                    path = save / f"{stream.name}.mp4"
                    recorder = Recorder(path, frame.width, frame.height)
                recorder.add(frame, detections)

    async with stream:  # leaving it closes the stream, which ends read()
        reader = asyncio.create_task(read())
        loop = asyncio.get_running_loop()
        end = loop.time() + duration
        first_pts: float | None = None
        started = loop.time()
        submitted = -1
        async for frame in source:
            if loop.time() >= end:
                break
            if paced and frame.pts is not None:  # a file plays as a camera would
                first_pts = frame.pts if first_pts is None else first_pts
                await asyncio.sleep(max(0.0, started + frame.pts - first_pts - loop.time()))
            submitted = stream.submit(frame, context=frame)  # its buffer is the engine's
        # Let the last frame offered be answered before the stream closes, so every
        # frame is answered or dropped, none cancelled half-way (unless the reader
        # ended first: its engine closed or died).
        last_offered = submitted
        if newest_answer < submitted:
            waiting = asyncio.ensure_future(answered.wait())
            await asyncio.wait((waiting, reader), return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
    await reader
    if recorder is not None:
        recorder.close()
        print(f"wrote {recorder.path}: {recorder.frames} frames with their boxes")
    return boxes, latencies


async def run(
    model: str | bytes,
    uris: Sequence[str],
    duration: float,
    *,
    decoder: str = "auto",
    save: str | None = None,
    trace: str | None = None,
    isolation: Literal["thread", "process"] = "thread",
) -> list[StreamStatistics]:
    """Run every camera for ``duration`` seconds; print and return each one's
    statistics. With ``save``, write an annotated video per camera into that directory;
    with ``trace``, the engine's timeline there (``aiodla trace-plot`` draws it); with
    ``isolation="process"``, each camera decodes in a process of its own."""
    detector = Detect(head="yolov5", classes=80, conf=0.25, iou=0.45)
    formats = {VideoSource(uri, decoder).format for uri in uris}
    if len(formats) != 1:  # one pre-processing an engine: one layout of its frames
        raise SystemExit(f"these cameras' decoders give different layouts: {sorted(formats)}")
    letterbox = ImagePreprocess(source=formats.pop(), order="rgb", resize="letterbox")
    folder = None if save is None else Path(save)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    async with Engine(model, preprocess={"images": letterbox}, postprocess=detector) as engine:
        sources = [
            VideoSource(
                uri, decoder, engine=engine, name=f"cam{i}", repeat=True, isolation=isolation
            )
            for i, uri in enumerate(uris)
        ]
        streams = [LatestFrameStream(engine, name=f"cam{i}") for i in range(len(uris))]
        timeline = engine.trace(trace, name="yolov5s") if trace else contextlib.nullcontext()
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(timeline)
            for source in sources:
                await stack.enter_async_context(source)
            feeds = [
                camera(source, stream, duration, folder, paced=not uri.startswith("rtsp"))
                for source, stream, uri in zip(sources, streams, uris, strict=True)
            ]
            results = await asyncio.gather(*feeds)
        stats = [stream.statistics() for stream in streams]
        runtime = engine.runtime.name if engine.runtime else "?"
        decoders = {source.decoder for source in sources}
    print(
        f"{len(uris)} cameras on the {runtime} runtime for {duration:g} s, "
        f"decoded by {', '.join(sorted(decoders))}"
    )
    print("camera     fps  dropped   capture-to-boxes p50 ms   p99 ms  boxes/frame")
    for s, (count, latencies) in zip(stats, results, strict=True):
        p50, p99 = np.percentile(latencies, (50, 99)) * 1e3 if latencies else (0.0, 0.0)
        print(
            f"{s.name:<6} {s.fps:7.1f} {s.dropped:8d} {p50:25.1f} {p99:8.1f} "
            f"{count / max(s.completed, 1):12.1f}"
        )
    return stats


def main(argv: Sequence[str] | None = None) -> list[StreamStatistics]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("uris", nargs="*", help="files or rtsp:// URIs; none: its own clips")
    parser.add_argument("--model", help="a loadable; default: the YOLOv5s emulator loadable")
    parser.add_argument("--decoder", default="auto", help="auto, ffmpeg, gstreamer or nvdec")
    parser.add_argument("--cameras", type=int, default=4, help="how many clips of its own")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds")
    parser.add_argument("--save", metavar="DIR", help="write an annotated video per camera")
    parser.add_argument("--trace", metavar="RUN.json", help="write the engine's timeline")
    parser.add_argument(
        "--isolation",
        choices=("thread", "process"),
        default="thread",
        help="where each camera decodes: a thread, or a process of its own (many cameras)",
    )
    parser.add_argument(
        "--latency",
        type=float,
        # Frames pre-processed with numpy (the emulated runtime, no GPU) cost the host a
        # few ms each: keep the emulated DLA the slower part.
        default=0.03,
        help="seconds per frame of the built-in model (2 cores: 66 fps at 0.03)",
    )
    args = parser.parse_args(argv)
    model = args.model or demo_model(args.latency)
    with tempfile.TemporaryDirectory() as workdir, contextlib.ExitStack() as stack:
        uris = args.uris or stack.enter_context(
            own_cameras(args.cameras, CLIP_SIZE, args.duration, Path(workdir))
        )
        run_it = run(
            model,
            uris,
            args.duration,
            decoder=args.decoder,
            save=args.save,
            trace=args.trace,
            isolation=args.isolation,
        )
        return asyncio.run(run_it)


if __name__ == "__main__":
    main()
