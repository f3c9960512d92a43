"""Build aiodla's GPU stand-in ``libcudla.so.1`` (a test double for cuDLA) with nvcc.

Usage: ``python -m aiodla.emulator.standin_build OUTDIR [--nvcc NVCC] [--arch ARCH]``;
prints the path of the built library. The plain function is
:func:`aiodla.emulator._standin.build_standin`.
"""

from ._standin import main

if __name__ == "__main__":
    raise SystemExit(main())
