"""The sdist and the wheel hold what they must: the sdist the whole project (a packager
runs the suite from it), the wheel the package alone.

Both are built offline, with ``python -m build --no-isolation`` and the setuptools the
``test`` extra installs, from a copy of this tree (a build writes ``*.egg-info`` and
``build/`` beside the sources, which must not leak into the next sdist). The wheel is
built from the sdist, as ``python -m build`` does by default, so it proves the sdist
complete enough to build from.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME = "aiodla"
# What a checkout holds that is not the project: caches, builds, environments.
NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.py[cod]",
    "*.so",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    ".coverage*",
    "htmlcov",
    ".venv",
    ".whl",
)
# The sdist's folders that are the project beside the package, shipped whole.
PROJECT_FOLDERS = ("tests", "examples", "benchmarks", "docs")
# Named outright, so that a walk that finds nothing cannot pass for a complete sdist.
MUST_SHIP = (
    "LICENSE",
    "README.md",
    "CHANGELOG.md",
    "pyproject.toml",
    "tests/conftest.py",
    "tests/support.py",
    "tests/vectors.py",
    "tests/gpu/conftest.py",
    "tests/gpu/device_run.sh",
    "tests/emulator/test_format.py",
    "tests/test_packaging.py",
    "examples/quickstart.py",
    "examples/metrics_server.py",
    "benchmarks/bench_engine.py",
    "aiodla/py.typed",
    "aiodla/emulator/standin/standin.cu",
    ".ci/run",
    "mkdocs.yml",
    "docs/gen_performance.py",
)

pytestmark = pytest.mark.timeout(300)  # two builds: about 5-40 s, by the machine


def build_unavailable() -> str | None:
    """Why ``python -m build --no-isolation`` cannot build this project here, or None."""
    if importlib.util.find_spec("build") is None:
        return "the 'build' package is not installed (pip install -e '.[test]')"
    try:
        setuptools = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        return "setuptools is not installed (pip install -e '.[test]')"
    if int(setuptools.split(".")[0]) < 77:
        return f"setuptools {setuptools} is older than 77, which pyproject.toml requires"
    return None


def files_under(root: Path) -> set[str]:
    """Every file below ``root`` that is a source, as a relative POSIX path."""
    found = set()
    for folder, dirs, names in os.walk(root):
        ignored = NOT_SOURCES(folder, [*dirs, *names])
        dirs[:] = [d for d in dirs if d not in ignored]  # os.walk descends only into these
        found.update(
            (Path(folder) / name).relative_to(root).as_posix()
            for name in names
            if name not in ignored
        )
    return found


class Built:
    def __init__(self, sdist: Path, wheel: Path, sources: Path) -> None:
        self.sources = sources
        with tarfile.open(sdist) as archive:
            names = archive.getnames()
        top = f"{sdist.name.removesuffix('.tar.gz')}/"
        assert all(name.startswith(top) or name == top.rstrip("/") for name in names)
        self.sdist = {name.removeprefix(top) for name in names if name.startswith(top)}
        with zipfile.ZipFile(wheel) as archive:
            self.wheel = set(archive.namelist())
            info = next(n for n in self.wheel if n.endswith(".dist-info/METADATA"))
            self.wheel_metadata = archive.read(info).decode("utf-8")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    reason = build_unavailable()
    if reason is not None:
        pytest.skip(f"cannot build offline: {reason}")
    sources = tmp_path_factory.mktemp("sources") / NAME
    shutil.copytree(ROOT, sources, ignore=NOT_SOURCES)
    out = tmp_path_factory.mktemp("dist")
    completed = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(sources)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Built(sdist, wheel, sources)


class TestSdist:
    def test_ships_the_named_files(self, built: Built) -> None:
        assert set(MUST_SHIP) - built.sdist == set()

    def test_ships_every_test_example_and_benchmark(self, built: Built) -> None:
        project = {
            path for path in files_under(built.sources) if path.split("/", 1)[0] in PROJECT_FOLDERS
        }
        assert len(project) > 30  # the walk found the project
        assert project - built.sdist == set()

    def test_ships_the_whole_package(self, built: Built) -> None:
        package = {p for p in files_under(built.sources) if p.startswith(f"{NAME}/")}
        assert package - built.sdist == set()

    def test_no_caches_or_builds(self, built: Built) -> None:
        assert not [p for p in built.sdist if "__pycache__" in p or p.endswith((".pyc", ".so"))]


class TestWheel:
    def test_holds_the_package_with_its_data(self, built: Built) -> None:
        package = {p for p in files_under(built.sources) if p.startswith(f"{NAME}/")}
        assert {
            "aiodla/__init__.py",
            "aiodla/py.typed",
            "aiodla/emulator/standin/standin.cu",
            "aiodla/emulator/standin/cudla_abi.h",
        } <= package
        assert package - built.wheel == set()

    def test_holds_the_package_alone(self, built: Built) -> None:
        outside = {
            p for p in built.wheel if not p.startswith(f"{NAME}/") and ".dist-info/" not in p
        }
        assert outside == set()  # no tests, examples or benchmarks as top-level packages

    def test_license(self, built: Built) -> None:
        licenses = {p.split(".dist-info/", 1)[1] for p in built.wheel if ".dist-info/" in p}
        assert "licenses/LICENSE" in licenses
        assert "License-Expression: Apache-2.0" in built.wheel_metadata
        assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_the_quickstart_runs_with_no_compiler_on_the_path(tmp_path: Path) -> None:
    # The installed package compiles nothing at run time: with no cc, gcc or clang to
    # be found (PATH names an empty folder), the quickstart serves all its requests.
    for compiler in ("cc", "gcc", "clang"):
        assert shutil.which(compiler, path=str(tmp_path)) is None
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("CC", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "requests" in done.stdout, done.stdout
