"""What ``benchmarks/bench_threads.py`` records as the revision it measured: the label
``compare_threads.py`` prints for each tree, so a wrong one misnames a published figure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(where: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    done = subprocess.run(["git", "-C", str(where), *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _revision_of(tree: Path) -> str:
    """bench_threads.revision() with ``tree``'s aiodla imported first."""
    path = os.pathsep.join([str(tree), str(ROOT / "benchmarks")])
    done = subprocess.run(
        [sys.executable, "-c", "import bench_threads; print(bench_threads.revision())"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A git checkout with one commit, the package copied into it."""
    shutil.copytree(
        ROOT / "aiodla", tmp_path / "aiodla", ignore=shutil.ignore_patterns("__pycache__")
    )
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "aiodla")
    _git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_a_checkout_is_named_by_its_commit(checkout: Path) -> None:
    head = _git(checkout, "rev-parse", "--short", "HEAD")
    assert _revision_of(checkout) == head
    (checkout / "aiodla" / "_extra.py").write_text("")
    assert _revision_of(checkout) == f"{head} with uncommitted changes in aiodla/"


def test_a_tree_inside_another_checkout_is_not_given_its_commit(checkout: Path) -> None:
    unpacked = checkout / "base"
    shutil.copytree(checkout / "aiodla", unpacked / "aiodla")
    assert _revision_of(unpacked) == "unknown: not a git checkout"
