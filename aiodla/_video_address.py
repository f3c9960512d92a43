"""Where a video source reads from, and its name with the credentials taken out.

A camera's URI often carries a user and password (``rtsp://admin:secret@cam/stream``).
The URI itself goes only to the decoder; everything aiodla shows — the source's name
in frames, statistics, metrics, traces, logs and errors — is :attr:`Address.name`, and
any text that came back from a decoder passes through :meth:`Address.redact` first,
since FFmpeg and GStreamer quote the URL they were given in their messages.
"""

from __future__ import annotations

import dataclasses
import os
import re
import urllib.parse
from typing import Literal

from ._errors import ConfigurationError

__all__ = ["Address", "SourceKind", "parse_address"]

SourceKind = Literal["file", "rtsp", "v4l2", "csi"]

_DEVICE = re.compile(r"^/dev/video\d+$")
# jetson-utils' spelling of an Argus camera: csi://0 is sensor-id 0.
_CSI = re.compile(r"^csi://(\d+)$")


@dataclasses.dataclass(frozen=True)
class Address:
    """A parsed source URI. ``uri`` is for the decoder only; ``name`` is for people."""

    uri: str
    name: str
    kind: SourceKind
    secrets: tuple[str, ...]  # the user-info strings to strip from any decoder message

    @property
    def live(self) -> bool:
        """A camera or stream (as opposed to a file, which ends at its end)."""
        return self.kind != "file"

    def redact(self, text: str) -> str:
        """``text`` with this source's credentials removed (as in :attr:`name`)."""
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    def __repr__(self) -> str:  # never the URI: a repr lands in logs and tracebacks
        return f"Address({self.name!r}, kind={self.kind!r})"


def parse_address(uri: object) -> Address:
    """The :class:`Address` of ``uri``: a path or ``file://`` URI, ``rtsp://`` or
    ``rtsps://``, ``/dev/videoN``, or ``csi://N``. ConfigurationError otherwise."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri:
        raise ConfigurationError(
            f"a video source needs a URI or path string, got {type(uri).__name__}"
        )
    if _DEVICE.match(uri):
        return Address(uri, uri, "v4l2", ())
    if _CSI.match(uri):
        return Address(uri, uri, "csi", ())
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme in ("rtsp", "rtsps"):
        secrets: tuple[str, ...] = ()
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, host = netloc.rpartition("@")
            # The raw and the percent-decoded spelling: a decoder may quote either.
            secrets = tuple(
                sorted({userinfo, urllib.parse.unquote(userinfo)}, key=len, reverse=True)
            )
            netloc = host
        name = urllib.parse.urlunsplit((scheme, netloc, parts.path, parts.query, ""))
        if not parts.hostname:
            raise ConfigurationError(f"the video source {name!r} names no host")
        return Address(uri, name, "rtsp", secrets)
    if scheme == "file":
        path = urllib.parse.unquote(parts.path)
        return Address(path, path, "file", ())
    if scheme and len(scheme) > 1:  # not a Windows drive letter
        raise ConfigurationError(
            f"the video source {uri.split(':', 1)[0]}://... is not one aiodla reads: give a "
            "file path, rtsp://, /dev/videoN or csi://N"
        )
    return Address(uri, uri, "file", ())
