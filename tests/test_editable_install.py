"""The README's editable install (``pip install -e .``) is one that type checkers see.

setuptools makes an editable install either a plain path in a ``.pth`` file, which
mypy and pyright read, or an import hook that only the interpreter runs (mypy then
says ``Cannot find implementation or library stub``). The project's build settings
(pyproject's ``[tool.setuptools]``) choose the path. Checked the way a user meets it:
the editable wheel that pip would install, built by the project's own build backend,
installed into a fresh virtual environment, and ``mypy --strict`` run on the quickstart
from a folder outside the repository.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _clean_environment() -> dict[str, str]:
    """This environment without the paths a developer may set to reach the checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}


def _install_editable(target: Path, scratch: Path) -> Path:
    """The editable wheel of the checkout, unpacked into a fresh environment at
    ``target`` (installing a wheel is unpacking it); its site-packages folder."""
    wheels = scratch / "wheels"
    build = (
        "import sys\nfrom setuptools import build_meta\n"
        "print(build_meta.build_editable(sys.argv[1]))"
    )
    subprocess.run(
        [sys.executable, "-c", build, str(wheels)],
        cwd=ROOT,
        env=_clean_environment(),
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = wheels.glob("*.whl")
    venv.create(target, with_pip=False)
    python = target / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=_clean_environment(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(purelib)
    return Path(purelib)


@pytest.mark.timeout(300)
def test_mypy_sees_aiodla_after_the_editable_install(tmp_path: Path) -> None:
    for module in ("mypy", "setuptools"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]')")
    # aiodla's dependencies (numpy's types, anyio) come from this environment, added as
    # a path: nothing there may provide aiodla itself, or the check would prove nothing.
    dependencies = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    if any((Path(folder) / "aiodla").is_dir() for folder in dependencies):
        pytest.skip("this environment has a non-editable aiodla installed")
    purelib = _install_editable(tmp_path / "env", tmp_path)
    (purelib / "zz_dependencies.pth").write_text("\n".join(dict.fromkeys(dependencies)) + "\n")

    app = tmp_path / "app"
    app.mkdir()
    shutil.copy(ROOT / "examples" / "quickstart.py", app / "quickstart.py")
    python = tmp_path / "env" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    command = [sys.executable, "-m", "mypy", "--strict", "--python-executable", str(python)]
    result = subprocess.run(
        [*command, "--cache-dir", str(tmp_path / "mypy-cache"), "quickstart.py"],
        cwd=app,
        env=_clean_environment(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success" in result.stdout
