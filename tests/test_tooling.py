"""The tree stays formatted and lint-clean, and the examples type-check strictly:
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


# Each line a call that the typed Engine signature must refuse, then one it takes.
_MISUSE = """\
from aiodla import BlockingEngine, Engine, ProcessIsolation
Engine(b"", stream_per_core=4)
Engine(b"", max_restarts=3)
Engine(b"", convert="gpu")
Engine(b"", streams_per_core="4")
BlockingEngine(b"", stream_per_core=4)
Engine(b"", isolation=ProcessIsolation(heartbeat_timeout=1.0), cores=range(2))
BlockingEngine(b"", runtime="emulated", isolation="process", max_queue=8)
"""


@pytest.mark.timeout(300)
def test_the_examples_type_check_strictly(tmp_path: Path) -> None:
    # What a user writes must pass `mypy --strict` against aiodla's public types, and a
    # misspelt or mistyped engine option must not. The package's own strict check
    # (pyproject's [tool.mypy]) depends on numpy's stubs, which change between numpy
    # releases: it is the lint step, not part of this test, so a numpy release cannot
    # fail a run that changed nothing.
    misuse = tmp_path / "misuse.py"
    misuse.write_text(_MISUSE)
    result = run(
        "mypy",
        "--strict",
        "--follow-imports=silent",
        "--cache-dir",
        str(tmp_path / "cache"),
        "examples",
        str(misuse),
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    refused = [line.split(":")[1] for line in errors if line.startswith(str(misuse))]
    assert refused == ["2", "3", "4", "5", "6"], result.stdout + result.stderr
    assert len(errors) == len(refused), result.stdout + result.stderr
