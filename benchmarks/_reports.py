"""Where a benchmark writes its JSON report: the path given, else a fresh temporary file.

``benchmarks/results/`` holds the reports that the README and CHANGELOG quote, each
measured on a stated machine. A run writes there only when told to (``--json
benchmarks/results/<name>.json``), so running a benchmark to see its figures never
overwrites what the repository records.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["report_path"]


def report_path(given: str | os.PathLike[str] | None, name: str) -> Path:
    """``given`` if set, else ``name`` in a new temporary directory; its folder exists."""
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix="aiodla-bench-")) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
