"""Video test material made on the spot: clips encoded with PyAV, and a real RTSP server.

:func:`encode_clip` writes a short H.264 or H.265 clip whose every frame differs (a
gradient that moves and a frame-numbered band), so a lost, repeated or reordered frame
shows. :class:`RtspServer` serves such clips over RTSP with GStreamer's gst-rtsp-server
in a process of its own (not a mock: the same server cameras' firmware often embeds),
and can be stopped and started again on the same port to test reconnecting.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = ["RtspServer", "encode_clip", "rtsp_server_python"]

_SERVE = Path(__file__).with_name("_rtsp_serve.py")
_ENCODERS = {"h264": "libx264", "h265": "libx265"}


def encode_clip(
    path: str | os.PathLike[str],
    codec: Literal["h264", "h265"] = "h264",
    *,
    frames: int = 60,
    size: tuple[int, int] = (320, 240),
    fps: int = 30,
    keyint: int = 15,
) -> Path:
    """Encode ``frames`` frames of ``size`` (width, height) at ``fps`` into ``path``
    (the container from its suffix: .mp4, .mkv, .mov, .ts), a keyframe every
    ``keyint`` frames, no B-frames (so decode order is display order). Needs PyAV."""
    import av

    width, height = size
    out: Any = av.open(str(path), "w")
    try:
        stream = out.add_stream(_ENCODERS[codec], rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        if codec == "h264":
            stream.options = {"g": str(keyint), "bf": "0", "preset": "veryfast"}
        else:
            stream.options = {
                "x265-params": f"keyint={keyint}:min-keyint={keyint}:bframes=0:log-level=error",
                "preset": "veryfast",
            }
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(clip_picture(index, width, height), format="rgb24")
            frame.pts = index
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    finally:
        out.close()
    return Path(path)


def clip_picture(index: int, width: int, height: int) -> np.ndarray[Any, Any]:
    """Frame ``index`` of :func:`encode_clip`'s clips, as RGB."""
    x = np.arange(width, dtype=np.int32)[None, :]
    y = np.arange(height, dtype=np.int32)[:, None]
    picture = np.empty((height, width, 3), np.uint8)
    picture[..., 0] = (x * 2 + index * 4) % 256
    picture[..., 1] = (y * 2 + index * 2) % 256
    picture[..., 2] = 64
    band = (index * 3) % max(1, height - 16)
    picture[band : band + 16, :, 2] = 230
    return picture


def rtsp_server_python() -> str | None:
    """A Python that can run the RTSP server (PyGObject with gst-rtsp-server's
    introspection data), or None; the test's own first, then the system's."""
    probe = (
        "import gi; gi.require_version('GstRtspServer', '1.0'); "
        "from gi.repository import GstRtspServer"
    )
    seen = set()
    for python in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if python is None or python in seen or not os.path.exists(python):
            continue
        seen.add(python)
        try:
            done = subprocess.run(
                [python, "-c", probe], capture_output=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return python
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RtspServer:
    """gst-rtsp-server serving clips: ``RtspServer({"cam1": (path, "h264")})``.

    ``url("cam1")`` is the stream's URL (``user``/``password`` put credentials in it;
    ``auth=("user", "password")`` makes the server require them). ``stop()`` kills the
    server (its clients see the connection drop); ``start()`` starts it again on the
    same port. A context manager: started on entry, stopped on exit.
    """

    def __init__(
        self,
        clips: Mapping[str, tuple[str | os.PathLike[str], str]],
        *,
        auth: tuple[str, str] | None = None,
        port: int | None = None,
        python: str | None = None,
    ) -> None:
        self._clips = dict(clips)
        self._auth = auth
        self.port = _free_port() if port is None else port
        self._python = python
        self._process: subprocess.Popen[bytes] | None = None

    def url(self, mount: str, *, user: str | None = None, password: str | None = None) -> str:
        credentials = "" if user is None else f"{user}:{password or ''}@"
        return f"rtsp://{credentials}127.0.0.1:{self.port}/{mount}"

    def start(self, timeout: float = 30.0) -> None:
        if self._process is not None:
            return
        python = self._python or rtsp_server_python()
        if python is None:
            raise RuntimeError(
                "no Python here runs gst-rtsp-server (Debian: apt-get install python3-gi "
                "gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-base "
                "gstreamer1.0-plugins-good gstreamer1.0-plugins-bad)"
            )
        self._python = python
        args = [python, str(_SERVE), str(self.port)]
        args += [
            f"{mount}={os.fspath(path)}:{codec}" for mount, (path, codec) in self._clips.items()
        ]
        if self._auth is not None:
            args += ["--auth", ":".join(self._auth)]
        # The system Python must not import this environment's packages.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        assert process.stdout is not None
        said = b""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while b"ready" not in said:
                left = deadline - time.monotonic()
                if left <= 0 or process.poll() is not None:
                    process.kill()
                    process.wait()
                    process.stdout.close()
                    raise RuntimeError(
                        f"the RTSP server did not start: {said.decode(errors='replace')}"
                    )
                if selector.select(left):
                    chunk = os.read(process.stdout.fileno(), 4096)
                    said += chunk
        self._process = process

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()

    @property
    def running(self) -> bool:
        return self._process is not None

    def __enter__(self) -> RtspServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """The server stopped for the block's duration, started again after it."""
        self.stop()
        try:
            yield
        finally:
            self.start()
