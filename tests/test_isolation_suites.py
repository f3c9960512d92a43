"""Every CI run checks both modes: the engine's behaviour suites, again in process mode.

``AIODLA_TEST_ISOLATION=process`` (tests/conftest.py) opens every emulated engine of a
suite with ``isolation="process"``, and aiodla.testing's controls then act in its
worker. Running all the suites so takes minutes; these two carry the most behaviour
(the engine's life cycle, timeouts, backpressure, statistics, health; cancellation in
every state) and take about half a minute together. The plugin's controls over a
worker have their own tests, in every run (tests/test_isolation_controls.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITES = ("tests/test_engine.py", "tests/test_cancellation.py")


@pytest.mark.skipif(
    os.environ.get("AIODLA_TEST_ISOLATION") == "process",
    reason="this run is in process mode already",
)
@pytest.mark.timeout(240)
def test_the_engine_suites_pass_in_process_mode() -> None:
    env = dict(os.environ, AIODLA_TEST_ISOLATION="process")
    # The outer run's coverage and cache stay out of the inner run's way.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:cov"]
    result = subprocess.run(
        [*command, *SUITES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert result.returncode == 0, (
        f"process mode: {summary[0]}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    )
    assert " failed" not in summary[0] and " passed" in summary[0], summary[0]
