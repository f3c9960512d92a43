"""The project's pytest configuration, as the README's test command runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(tests: Path, *options: str) -> str:
    # The project's configuration (-c) on a file of its own, so the outcome is known.
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tests), *options, str(tests)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert completed.returncode == 1, completed.stdout + completed.stderr
    return completed.stdout


def summary_lines(out: str, kind: str) -> list[str]:
    """The short summary's lines of one kind, each cut to the part after the test file's
    folder (pytest may spell that folder absolute)."""
    return [line.rsplit("/", 1)[-1] for line in out.splitlines() if line.startswith(kind)]


class TestSummary:
    SOURCE = (
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert False\n"
        "@pytest.mark.skip(reason='no GPU here')\n"
        "def test_skipped(): pass\n"
    )

    def test_names_failures_not_skips(self, tmp_path: Path) -> None:
        (tmp_path / "test_sample.py").write_text(self.SOURCE)
        out = run_pytest(tmp_path)
        assert summary_lines(out, "FAILED") == ["test_sample.py::test_fails"]
        assert "SKIPPED" not in out  # without a GPU, ~90 such lines buried the failures
        assert "1 failed, 1 passed, 1 skipped" in out

    def test_rs_shows_the_skips(self, tmp_path: Path) -> None:
        (tmp_path / "test_sample.py").write_text(self.SOURCE)
        out = run_pytest(tmp_path, "-rs")
        assert summary_lines(out, "SKIPPED [1]") == ["test_sample.py:4: no GPU here"]
