"""Regenerate ``grpc_service_pb2.py`` and ``.pyi`` from ``grpc_service.proto``.

Run ``python -m aiodla.serve._pb._generate`` after editing the ``.proto``; it needs
grpcio-tools (not a dependency of the ``serve`` extra: the generated modules are
committed). ``tests/serve/test_serve_generated.py`` regenerates into a temporary folder and
checks that the committed files are the same.

protoc's module registers its messages in protobuf's default descriptor pool, and so
does tritonclient's own ``grpc_service.proto``, with the same package and other
contents: in one process (a test, a server that also calls Triton) the second file to
load would fail with a duplicate symbol. So the one line that names the default pool
is rewritten to a pool of this module's own; messages on the wire are unaffected.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

__all__ = ["generate", "main"]

HERE = Path(__file__).resolve().parent
PROTO = "grpc_service.proto"
OUTPUTS = ("grpc_service_pb2.py", "grpc_service_pb2.pyi")

_DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
_OWN_POOL = (
    "# aiodla: a pool of this module's own, not the default one that tritonclient's\n"
    "# grpc_service.proto also fills (see aiodla/serve/_pb/_generate.py).\n"
    "_POOL = _descriptor_pool.DescriptorPool()\n"
    "DESCRIPTOR = _POOL.AddSerializedFile("
)


# Generated code is kept byte for byte as protoc wrote it (the test compares): ruff
# neither formats nor lints it, even run over the whole tree by hand, and mypy skips it.
# mypy reads the .pyi; protobuf ships no types, so its classes would be Any.
_KEEP_AS_IS = "# ruff: noqa\n# fmt: off\n# mypy: ignore-errors\n"


def generate(out: Path) -> list[Path]:
    """Write the generated modules into ``out``; return their paths."""
    from grpc_tools import protoc  # type: ignore[import-untyped,unused-ignore]

    with tempfile.TemporaryDirectory() as raw:
        args = ["protoc", f"-I{HERE}", f"--python_out={raw}", f"--pyi_out={raw}", PROTO]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {HERE / PROTO}")
        written = []
        for name in OUTPUTS:
            text = _KEEP_AS_IS + (Path(raw) / name).read_text()
            if name.endswith(".py"):
                if text.count(_DEFAULT_POOL) != 1:
                    raise RuntimeError(f"protoc's {name} no longer reads as expected")
                text = text.replace(_DEFAULT_POOL, _OWN_POOL)
            target = out / name
            target.write_text(text)
            written.append(target)
    return written


def main() -> None:
    for path in generate(HERE):
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
