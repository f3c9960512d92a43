"""examples/several_models.py: a detector and a batch-8 classifier on one aiodla.Cores."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from support import counts_add_up

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "several_models.py"


# The example opens its Cores with runtime="auto": in-process, as the example runs.
@pytest.mark.in_process
@pytest.mark.asyncio
async def test_every_object_of_every_frame_is_classified(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = importlib.util.spec_from_file_location("several_models", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("several_models", example)
    spec.loader.exec_module(example)
    det, cls = await example.run(cameras=3, frames=4, shape=(135, 240))
    assert det.completed == 12 and counts_add_up(det) and counts_add_up(cls)
    items = cls.batching
    assert items is not None
    assert items.completed == items.items > 0  # every crop classified, none lost
    assert sum(size * n for size, n in items.sizes.items()) == items.items
    assert max(items.sizes) > 1  # crops of a frame went together
    assert "objects per frame" in capsys.readouterr().out
