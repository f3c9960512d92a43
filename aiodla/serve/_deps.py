"""The ``serve`` extra's libraries, imported first so that a base install says which
extra to install instead of naming the first module it lacks."""

from __future__ import annotations

__all__ = ["MISSING_EXTRA"]

MISSING_EXTRA = (
    "aiodla.serve needs aiohttp, grpcio, protobuf and prometheus_client, which the "
    "'serve' extra installs: pip install 'aiodla[serve]'"
)

try:
    import aiohttp  # noqa: F401
    import grpc  # type: ignore[import-untyped,unused-ignore]  # noqa: F401
    import prometheus_client  # noqa: F401
    from google import protobuf  # type: ignore[import-untyped,unused-ignore]  # noqa: F401
except ImportError as exc:
    raise ImportError(f"{MISSING_EXTRA} ({exc})") from exc
