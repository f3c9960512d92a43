"""``aiodla doctor`` says which video decoders this machine has."""

from __future__ import annotations

import pytest

from aiodla import _video_decoders
from aiodla._doctor_checks import video_decoders_check
from aiodla._video_decoders import available_decoders


def test_the_line_names_what_is_here_and_what_auto_takes() -> None:
    found = available_decoders()
    finding = video_decoders_check()
    have = [name for name, why in found.items() if why is None]
    if not have:
        pytest.skip("no decoder here")
    assert finding.status == "ok"
    assert finding.detail.startswith(", ".join(have) + " (auto takes ")
    for name, why in found.items():
        if why is not None:
            assert f"{name}: {why}" in finding.detail


def test_no_decoder_is_a_warning_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_video_decoders, "missing", lambda name: f"no {name} here")
    finding = video_decoders_check()
    assert finding.status == "warn"
    assert "ffmpeg: no ffmpeg here" in finding.detail
    assert finding.fix is not None and "aiodla[video]" in finding.fix
