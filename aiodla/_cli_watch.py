"""``aiodla watch URI... --model det.bin``: cameras into a detector, watched live.

Each URI is a :class:`~aiodla.VideoSource` writing into the engine's frame buffers and
feeding a :class:`~aiodla.LatestFrameStream` of its own; the engine letterboxes each
frame from the decoder's own YUV and answers with ``Detect``'s boxes. Every
``--interval`` seconds it prints, per camera, the rate of answered frames, the
capture-to-boxes latency (from the moment a frame was decoded to its boxes) and what
was dropped (by the source, or by its stream while the engine was busy) or
reconnected, then the process's CPU: what a deployment would cost the
host.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any, cast

import click
import numpy as np

from ._cli_frame import CommandError, debug_option, describe, runtime_option
from ._detect import Detect
from ._engine import Engine
from ._errors import AiodlaError
from ._preprocess import ImagePreprocess
from ._session import LatestFrameStream
from ._video_address import parse_address
from ._video_source import VideoSource

__all__ = ["watch_command"]

_HEADS = ("yolov5", "yolov7", "yolov8", "yolo11", "yolox", "boxes")


class _Camera:
    """One camera's window of answers since the last report."""

    def __init__(self, source: VideoSource, stream: LatestFrameStream) -> None:
        self.source = source
        self.stream = stream
        self.latencies: list[float] = []
        self.answered = 0
        self.boxes = 0

    async def feed(self, paced: bool) -> None:
        loop = asyncio.get_running_loop()
        start: tuple[float, float] | None = None
        async for frame in self.source:
            if paced and frame.pts is not None:  # a file plays at its frame rate
                if start is None or frame.pts < start[1]:  # the first, or the file again
                    start = (loop.time(), frame.pts)
                await asyncio.sleep(max(0.0, start[0] + frame.pts - start[1] - loop.time()))
            self.stream.submit(frame, context=frame.captured_at)

    async def read(self) -> None:
        async for result in self.stream:
            if result.error is None:
                self.latencies.append(time.time() - result.context)
                self.answered += 1
                self.boxes += len(result.output)

    def report(self, seconds: float) -> str:
        stats = self.source.statistics()
        p50, p99 = np.percentile(self.latencies, (50, 99)) * 1e3 if self.latencies else (0.0, 0.0)
        line = (
            f"{stats.name[:38]:<38} {self.answered / seconds:6.1f} {p50:8.1f} {p99:8.1f} "
            f"{stats.dropped + self.stream.statistics().dropped:8d} {stats.reconnects:5d}  "
            f"{stats.state}" + (f" ({stats.reason})" if stats.reason else "")
        )
        self.latencies.clear()
        self.answered = 0
        return line


async def _color_range(uri: str, decoder: str) -> Any:
    """The YUV range of a local source's frames, from its first frame (a USB camera's
    MJPEG is full range); network streams are H.264 or H.265, limited range, and are
    not opened twice for it."""
    if parse_address(uri).kind not in ("file", "v4l2"):
        return "limited"
    async with VideoSource(uri, decoder, reconnect=False) as probe:
        async for frame in probe:
            return frame.color_range
    return "limited"  # a file without a frame: the engine will not see one either


def _where(cameras: Sequence[Any]) -> str:
    """Where the cameras decode, as their sources say (nothing for reader threads)."""
    isolated = [c.source.statistics().isolation == "process" for c in cameras]
    return " in processes of their own" if all(isolated) else ""


async def watch(
    model: bytes,
    uris: Sequence[str],
    *,
    head: str,
    classes: int,
    decoder: str,
    transport: str,
    runtime: str,
    seconds: float,
    interval: float,
    isolation: str = "thread",
) -> None:
    rtsp = cast(Any, transport)  # "tcp" or "udp", as click checked
    probes = [VideoSource(uri, decoder, transport=rtsp) for uri in uris]
    formats = {probe.format for probe in probes}
    if len(formats) != 1:
        raise CommandError(f"these cameras' decoders give different layouts: {sorted(formats)}")
    ranges = {await _color_range(uri, decoder) for uri in uris}
    if len(ranges) != 1:
        raise CommandError(
            f"these cameras' frames come in different YUV ranges: {sorted(ranges)} (a USB "
            "camera's MJPEG is full range, H.264 and H.265 limited); watch them apart"
        )
    letterbox = ImagePreprocess(
        source=formats.pop(), order="rgb", resize="letterbox", color_range=ranges.pop()
    )
    async with Engine(model, runtime=runtime) as probe:
        image = probe.inputs[0].name
    detector = Detect(head=cast(Any, head), classes=classes)
    async with (
        Engine(
            model, runtime=runtime, preprocess={image: letterbox}, postprocess=detector
        ) as engine,
        contextlib.AsyncExitStack() as stack,
    ):
        cameras = []
        for uri in uris:
            # A file plays as a camera would: at its frame rate, over and over.
            source = VideoSource(
                uri,
                decoder,
                engine=engine,
                transport=rtsp,
                repeat=True,
                isolation=cast(Any, isolation),  # "thread" or "process", as click checked
            )
            await stack.enter_async_context(source)
            stream = await stack.enter_async_context(LatestFrameStream(engine, name=source.name))
            cameras.append(_Camera(source, stream))
        click.echo(
            f"{len(cameras)} camera(s), decoded by "
            f"{', '.join(sorted({c.source.decoder for c in cameras}))}"
            f"{_where(cameras)}, into {image!r} of "
            f"the model on the {engine.runtime.name if engine.runtime else '?'} runtime"
        )
        tasks = [asyncio.create_task(c.feed(not c.source.live)) for c in cameras]
        tasks += [asyncio.create_task(c.read()) for c in cameras]
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds if seconds > 0 else float("inf")
        try:
            while loop.time() < end:
                wall, cpu = time.monotonic(), time.process_time()
                decoded = sum(c.source.statistics().decode_cpu for c in cameras)
                await asyncio.sleep(min(interval, max(0.0, end - loop.time())))
                wall, cpu = time.monotonic() - wall, time.process_time() - cpu
                decode = sum(c.source.statistics().decode_cpu for c in cameras)
                click.echo(
                    f"{'camera':<38} {'fps':>6} {'p50 ms':>8} {'p99 ms':>8} "
                    f"{'dropped':>8} {'recon':>5}  state"
                )
                for camera in cameras:
                    click.echo(camera.report(wall))
                # Decoding processes: this process's clock does not see their CPU; the
                # sources count it (with the readers' copying, which it does see).
                elsewhere = (
                    f", decoding processes {100 * (decode - decoded) / wall:.0f}%"
                    if isolation == "process"
                    else ""
                )
                click.echo(
                    f"host CPU {100 * cpu / wall:.0f}% of one core{elsewhere} (decoding, "
                    f"all sources so far: {decode:.1f} s)"
                )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@click.command("watch", short_help="Cameras into a detector: frame rate, latency, CPU.")
@click.argument("uris", nargs=-1, required=True, metavar="URI...")
@click.option("--model", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The detector's loadable (an emulator loadable works too).")  # fmt: skip
@click.option("--head", type=click.Choice(_HEADS), default="yolov5", show_default=True,
              help="The detector's head layout (see Detect).")  # fmt: skip
@click.option("--classes", type=click.IntRange(min=1), default=80, show_default=True)
@click.option("--decoder", type=click.Choice(["auto", "ffmpeg", "gstreamer", "nvdec"]),
              default="auto", show_default=True)  # fmt: skip
@click.option("--transport", type=click.Choice(["tcp", "udp"]), default="tcp",
              show_default=True, help="RTSP transport.")  # fmt: skip
@click.option("--isolation", type=click.Choice(["thread", "process"]), default="thread",
              show_default=True,
              help="Where each camera decodes: a thread, or a process of its own.")  # fmt: skip
@click.option("--seconds", type=click.FloatRange(min=0), default=0, show_default=True,
              help="Stop after this long (0: until Ctrl-C).")  # fmt: skip
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between reports.")  # fmt: skip
@runtime_option()
@debug_option
def watch_command(
    uris: tuple[str, ...],
    model: str,
    head: str,
    classes: int,
    decoder: str,
    transport: str,
    isolation: str,
    seconds: float,
    interval: float,
    runtime: str,
) -> None:
    """Run each camera URI (a file, rtsp://, /dev/videoN, csi://N) through the detector
    MODEL and print, every --interval seconds, each camera's answered frames a second,
    capture-to-boxes latency (p50, p99), dropped frames and reconnects, and the host's
    CPU. Credentials in a URI are used to connect and never printed."""
    with open(model, "rb") as file:
        data = file.read()
    try:
        asyncio.run(
            watch(
                data,
                uris,
                head=head,
                classes=classes,
                decoder=decoder,
                transport=transport,
                runtime=runtime,
                seconds=seconds,
                interval=interval,
                isolation=isolation,
            )
        )
    except KeyboardInterrupt:
        click.echo("aiodla watch: interrupted", err=True)
    except AiodlaError as exc:
        raise CommandError(describe(exc)) from None
