"""The tree stays formatted and lint-clean, and the quickstart type-checks strictly:
checked in every test run, so CI holds them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = ["aiodla", "tests", "benchmarks", "examples"]


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]')")
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True
    )


def test_the_tree_is_formatted() -> None:
    result = run("ruff", "format", "--check", *TREES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tree_passes_lint() -> None:
    result = run("ruff", "check", *TREES)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_the_quickstart_type_checks_strictly(tmp_path: Path) -> None:
    # What a user writes first must pass `mypy --strict` against aiodla's public types.
    # The package's own strict check (pyproject's [tool.mypy]) depends on numpy's stubs,
    # which change between numpy releases: it is the lint step, not part of this test,
    # so a numpy release cannot fail a run that changed nothing.
    result = run(
        "mypy",
        "--strict",
        "--follow-imports=silent",
        "--cache-dir",
        str(tmp_path),
        "examples/quickstart.py",
    )
    assert result.returncode == 0, result.stdout + result.stderr
