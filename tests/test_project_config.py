"""The project's pytest configuration, as the README's test command runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(tests: Path, *options: str) -> str:
    # The project's configuration (-c) on a file of its own, so the outcome is known.
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tests),
            *options,
            str(tests),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 1, completed.stdout + completed.stderr
    return completed.stdout


def summary_lines(out: str, kind: str) -> list[str]:
    """The short summary's lines of one kind, each cut to the test's name: the part after
    the test file's folder (pytest may spell that folder absolute) and before the
    message that pytest appends when the terminal is wide enough."""
    names = [line.split(" - ", 1)[0] for line in out.splitlines() if line.startswith(kind)]
    return [name.rsplit("/", 1)[-1] for name in names]


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


class TestCiScript:
    """.ci/run takes its Pythons from pyenv: the floor requires-python names, and the
    newest; the stand-in pyenv root below holds only empty executables."""

    CI = ROOT / ".ci" / "run"

    def fake_pyenv(self, root: Path, versions: list[str]) -> Path:
        for version in versions:
            python = root / "versions" / version / "bin" / "python"
            python.parent.mkdir(parents=True)
            python.write_text("#!/bin/sh\nexit 1\n")
            python.chmod(0o755)
        # A `python` first on PATH that fails: a script that went past choosing its
        # Pythons (to install, or test with the one on PATH) fails at once.
        stub = root / "stub-bin"
        stub.mkdir()
        (stub / "python").write_text("#!/bin/sh\nexit 1\n")
        (stub / "python").chmod(0o755)
        return stub

    def list_pythons(self, root: Path, stub: Path) -> subprocess.CompletedProcess[str]:
        env = {"PYENV_ROOT": str(root), "PATH": f"{stub}:/usr/bin:/bin", "HOME": str(root)}
        return subprocess.run(
            ["bash", str(self.CI), "--list"],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
            check=False,
        )

    def test_the_floor_and_the_newest_patch_releases(self, tmp_path: Path) -> None:
        stub = self.fake_pyenv(
            tmp_path, ["3.10.2", "3.10.13", "3.11.7", "3.13.0", "3.13.0t", "3.13-dev", "3.100.1"]
        )
        listed = self.list_pythons(tmp_path, stub)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.split() == [
            str(tmp_path / "versions" / v / "bin" / "python") for v in ("3.10.13", "3.13.0")
        ]
        pyproject = (ROOT / "pyproject.toml").read_text()
        assert 'requires-python = ">=3.10"' in pyproject  # the floor CI runs

    def test_a_missing_python_is_named(self, tmp_path: Path) -> None:
        stub = self.fake_pyenv(tmp_path, ["3.10.13"])
        listed = self.list_pythons(tmp_path, stub)
        assert listed.returncode != 0
        assert f"no Python 3.13 under {tmp_path}/versions" in listed.stderr
