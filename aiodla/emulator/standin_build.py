"""Build aiodla's GPU stand-in ``libcudla.so.1`` (a test double for cuDLA) with nvcc.

Usage: ``python -m aiodla.emulator.standin_build OUTDIR [--nvcc NVCC] [--arch ARCH]``;
prints the path of the built library. The plain function is
:func:`aiodla.emulator._standin.build_standin`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .._errors import ConfigurationError
from ._standin import build_standin


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aiodla.emulator.standin_build OUTDIR [--nvcc NVCC] [--arch ARCH]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m aiodla.emulator.standin_build",
        description="Build aiodla's GPU stand-in libcudla.so.1 (a test double for cuDLA).",
    )
    parser.add_argument("output_dir", help="directory to write libcudla.so.1 into")
    parser.add_argument("--nvcc", default="nvcc", help="the CUDA compiler (default: nvcc)")
    parser.add_argument("--arch", default=None, help="GPU target, e.g. sm_90 (default: detect)")
    parser.add_argument(
        "--host-fake", action="store_true", help="build the CPU-only test variant instead"
    )
    args = parser.parse_args(argv)
    try:
        path = build_standin(
            args.output_dir, nvcc=args.nvcc, arch=args.arch, host_fake=args.host_fake
        )
    except (FileNotFoundError, RuntimeError, ConfigurationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
