"""An RTSP server over GStreamer's gst-rtsp-server, run as its own process.

    python -m aiodla.testing._rtsp_serve PORT MOUNT=FILE[:CODEC] ... [--auth USER:PASSWORD]

serves each FILE (any container GStreamer's ``parsebin`` reads: MP4, MKV, MPEG-TS)
at ``rtsp://127.0.0.1:PORT/MOUNT`` in real time, without re-encoding; CODEC is
``h264`` (the default) or ``h265``. Every client gets its own pipeline, from the file's
start. It prints ``ready`` once it listens, and serves until killed.

This runs under a Python that has PyGObject and gst-rtsp-server's introspection data
(on Debian: ``python3-gi``, ``gir1.2-gst-rtsp-server-1.0``, ``gstreamer1.0-plugins-bad``
for the parsers); :class:`aiodla.testing.RtspServer` finds one and starts it.
"""

from __future__ import annotations

import sys
from typing import Any

_PAYLOADERS = {"h264": "rtph264pay", "h265": "rtph265pay"}


def main(argv: list[str]) -> int:
    import gi

    gi.require_version("Gst", "1.0")
    gi.require_version("GstRtspServer", "1.0")
    from gi.repository import GLib, Gst, GstRtspServer

    Gst.init(None)
    port, *rest = argv
    auth: str | None = None
    mounts: list[str] = []
    args = iter(rest)
    for arg in args:
        if arg == "--auth":
            auth = next(args)
        else:
            mounts.append(arg)
    server: Any = GstRtspServer.RTSPServer()
    server.set_service(port)
    points = server.get_mount_points()
    for mount in mounts:
        name, _, spec = mount.partition("=")
        path, _, codec = (
            spec.rpartition(":") if spec.endswith((":h264", ":h265")) else (spec, "", "h264")
        )
        factory = GstRtspServer.RTSPMediaFactory()
        # A path with spaces or quotes would break the launch line: the tests' clips
        # live in pytest's temporary directories, which have neither.
        factory.set_launch(
            f"( filesrc location={path} ! parsebin ! {_PAYLOADERS[codec]} name=pay0 pt=96 "
            "config-interval=1 )"
        )
        factory.set_shared(False)
        if auth is not None:
            user, _, password = auth.partition(":")
            factory.add_role_from_structure(
                Gst.Structure.new_from_string(
                    "user, media.factory.access=(boolean)true, "
                    "media.factory.construct=(boolean)true"
                )
            )
            checker = GstRtspServer.RTSPAuth()
            token = GstRtspServer.RTSPToken()
            token.set_string("media.factory.role", "user")
            checker.add_basic(GstRtspServer.RTSPAuth.make_basic(user, password), token)
            server.set_auth(checker)
        points.add_factory("/" + name.lstrip("/"), factory)
    if server.attach(None) == 0:
        print(f"cannot listen on port {port}", file=sys.stderr, flush=True)
        return 1
    print("ready", flush=True)
    GLib.MainLoop().run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
