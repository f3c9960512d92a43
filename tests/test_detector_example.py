"""examples/detector_tests.py runs as a user's suite would: pytest with the plugin
loaded by its entry point, on an emulated three-head detector with its own compute."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiodla.emulator._format import OPS

pytest_plugins = ["pytester"]

EXAMPLE = Path(__file__).parent.parent / "examples" / "detector_tests.py"


@pytest.mark.skipif(
    "mix" not in OPS,
    reason="a model of one input and three outputs needs the emulator's general op 'mix'",
)
def test_the_detector_example_passes(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        "[pytest]\n"
        "asyncio_mode = strict\n"
        "asyncio_default_fixture_loop_scope = function\n"
        "filterwarnings = error\n"
        "timeout = 60\n"
    )
    pytester.makepyfile(test_detector=EXAMPLE.read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


@pytest.mark.skipif("mix" not in OPS, reason="as above: the example's model needs 'mix'")
@pytest.mark.timeout(300)
def test_the_documented_command_runs_from_the_repository_root() -> None:
    # The repository's own pytest settings disable the plugin's entry point
    # (pyproject's addopts): examples/conftest.py loads it for the examples.
    root = EXAMPLE.parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "examples/detector_tests.py", "-p", "no:cacheprovider"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout, done.stdout
