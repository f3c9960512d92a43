"""The GPU stand-in for the benchmarks that run on the CUDA runtime: the library named by
``--standin`` / ``AIODLA_STANDIN_LIB``, else one built here with nvcc, loaded so that
``cuda.bindings.cudla`` finds it."""

from __future__ import annotations

import tempfile
from pathlib import Path


def load_standin(path: str | None) -> Path:
    """Load the stand-in at ``path`` (built into a temporary folder when None); its path."""
    from aiodla.emulator._standin import build_standin
    from aiodla.emulator._standin import load_standin as load

    found = Path(path) if path else build_standin(tempfile.mkdtemp(prefix="aiodla-bench-"))
    load(found)
    return found
