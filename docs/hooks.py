"""MkDocs hook: pages generated at build time from the code and the measurements.

The API reference comes from each public module's ``__all__`` (``gen_reference.py``) and
the performance page with its figures from ``benchmarks/results/*.json``
(``gen_performance.py``), so what the site says cannot drift from either.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from mkdocs.structure.files import File, Files

HERE = Path(__file__).resolve().parent


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: Any) -> Files:
    reference = _load("gen_reference")
    performance = _load("gen_performance")
    for path, text in reference.reference_pages().items():
        files.append(File.generated(config, path, content=text))
    page = performance.build(performance.RESULTS)
    files.append(File.generated(config, "performance.md", content=page.markdown))
    for name, data in page.figures.items():
        files.append(File.generated(config, f"performance/{name}", content=data))
    return files
