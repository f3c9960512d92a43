"""Loading the gstreamer decoder leaves the process able to run C++ code afterwards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aiodla._video_decoders import missing

_why = missing("gstreamer")
pytestmark = pytest.mark.skipif(_why is not None, reason=f"no gstreamer decoder here: {_why}")


def test_cxx_exceptions_still_work_after_gstreamer_loads() -> None:
    """GStreamer's library brings libunwind; without libgcc_s loaded first, the next C++
    module to throw (matplotlib's FreeType wrapper, at import) aborted the process,
    and with it any test suite that used the gstreamer decoder before drawing a plot."""
    pytest.importorskip("matplotlib")
    script = (
        "import numpy\n"
        "import aiodla._video_gstreamer\n"
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n"
        "figure, axes = plt.subplots()\n"
        "axes.plot([1, 2])\n"
        "figure.savefig(__import__('io').BytesIO(), format='svg')\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
