"""Source URIs: what each reads as, and the credentials that never leave the decoder."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiodla import ConfigurationError, VideoSourceError
from aiodla._video_address import parse_address
from aiodla._video_decoders import available_decoders, choose_decoder


class TestAddresses:
    @pytest.mark.parametrize(
        ("uri", "kind", "name"),
        [
            ("clip.mp4", "file", "clip.mp4"),
            (Path("/videos/a b.mkv"), "file", "/videos/a b.mkv"),
            ("file:///videos/a%20b.mkv", "file", "/videos/a b.mkv"),
            ("/dev/video0", "v4l2", "/dev/video0"),
            ("csi://1", "csi", "csi://1"),
            ("rtsp://cam1:8554/stream?ch=2", "rtsp", "rtsp://cam1:8554/stream?ch=2"),
            ("rtsp://admin:s%40cret@cam1/stream", "rtsp", "rtsp://cam1/stream"),
            ("RTSPS://u:p@cam1/s", "rtsp", "rtsps://cam1/s"),
        ],
    )
    def test_kinds_and_names(self, uri: object, kind: str, name: str) -> None:
        address = parse_address(uri)
        assert (address.kind, address.name) == (kind, name)
        assert address.live is (kind != "file")

    def test_credentials_are_redacted_in_both_spellings_and_never_in_the_repr(self) -> None:
        address = parse_address("rtsp://admin:s%40cret@cam1/stream")
        assert address.uri == "rtsp://admin:s%40cret@cam1/stream"  # for the decoder only
        said = "401 for 'rtsp://admin:s%40cret@cam1/stream' (user admin:s@cret)"
        assert address.redact(said) == "401 for 'rtsp://***@cam1/stream' (user ***)"
        assert "cret" not in repr(address)

    @pytest.mark.parametrize(
        ("uri", "match"),
        [
            ("http://u:secret@cam/x", "http://... is not one aiodla reads"),
            ("rtsp:///stream", "names no host"),
            ("", "needs a URI or path"),
            (42, "needs a URI or path"),
        ],
    )
    def test_refused(self, uri: object, match: str) -> None:
        with pytest.raises(ConfigurationError, match=match) as caught:
            parse_address(uri)
        assert "secret" not in str(caught.value)


class TestDecoderChoice:
    def test_every_decoder_is_listed_with_why_it_cannot_run(self) -> None:
        found = available_decoders()
        assert set(found) == {"ffmpeg", "gstreamer", "nvdec"}
        for why in found.values():
            assert why is None or (isinstance(why, str) and why)

    def test_auto_takes_one_that_can_run(self) -> None:
        found = available_decoders()
        if all(found.values()):
            pytest.skip("no decoder here")
        assert found[choose_decoder("auto", parse_address("clip.mp4"))] is None

    def test_a_named_decoder_that_cannot_run_says_why(self) -> None:
        found = available_decoders()
        missing = [name for name, why in found.items() if why is not None]
        if not missing:
            pytest.skip("every decoder runs here")
        with pytest.raises(VideoSourceError, match=f"decoder '{missing[0]}' cannot run") as caught:
            choose_decoder(missing[0], parse_address("rtsp://u:pw@cam/s"))
        assert caught.value.reason == "decoder"
        assert "pw" not in str(caught.value)

    def test_nvdec_does_not_read_usb_cameras(self) -> None:
        with pytest.raises(VideoSourceError, match=r"NVDEC does not read|cannot run"):
            choose_decoder("nvdec", parse_address("/dev/video0"))
