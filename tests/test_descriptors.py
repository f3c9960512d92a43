"""cuDLA descriptors (aiodla._descriptors): the table of accepted pairs, every rule a
descriptor must meet, and the round trip between descriptors and specs."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings

from aiodla._descriptors import DataCategory, DataFormat, DataType, TensorDescriptor
from aiodla._errors import ModelError
from aiodla._tensors import TensorSpec

from tensor_reference import (
    ACCEPTED,
    DTYPES,
    MODES,
    PAIRS,
    REFUSED,
    in_mode,
    reference_pack,
    same_bits,
    specs,
)

# -- every accepted pair, every refused pair ---------------------------------------------


class TestPairs:
    @pytest.mark.parametrize(("fmt", "dtype"), PAIRS)
    def test_accepted_pair_round_trips(self, fmt: str, dtype: str) -> None:
        c = 3 if fmt == "hwc4" else 5
        spec = TensorSpec("x", (1, c, 2, 3), dtype, fmt)
        info = np.finfo(dtype) if np.dtype(dtype).kind == "f" else np.iinfo(dtype)
        values = np.linspace(float(info.min) / 2, float(info.max) / 2, math.prod(spec.shape))
        array = values.reshape(spec.shape).astype(dtype)
        for mode in MODES:
            with in_mode(mode):
                packed = spec.pack(array)
                assert packed.tobytes() == reference_pack(spec, array)
                assert same_bits(spec.unpack(packed), array)
        assert TensorSpec.from_descriptor(spec.to_descriptor()) == spec

    @pytest.mark.parametrize(("fmt", "dtype"), REFUSED)
    def test_refused_pair_raises(self, fmt: str, dtype: str) -> None:
        with pytest.raises(ModelError, match=f"does not accept {dtype}.*in format {fmt}"):
            TensorSpec("x", (1, 3, 2, 2), dtype, fmt)

    def test_the_table(self) -> None:
        # TensorRT's DLA rules for the vectorized formats; nchw/nhwc take all six.
        assert ACCEPTED["chw16"] == ["float16"]
        assert ACCEPTED["chw32"] == ["int8"]
        assert ACCEPTED["hwc4"] == ["float16", "int8", "uint8"]
        assert ACCEPTED["nchw"] == ACCEPTED["nhwc"] == sorted(DTYPES)


# -- specs and descriptors ---------------------------------------------------------------


def descriptor(**changes: Any) -> TensorDescriptor:
    """A valid float16 chw16 descriptor, with some fields changed."""
    fields: dict[str, Any] = dict(
        name="input_0",
        size=1536,
        n=2,
        c=20,
        h=3,
        w=4,
        data_format=int(DataFormat.NCxHWx),
        data_type=int(DataType.HALF),
        data_category=int(DataCategory.FEATURE),
        pixel_format=36,
        pixel_mapping=0,
        stride=(32, 128, 384, 768, 0, 0, 0, 0),
    )
    fields.update(changes)
    return TensorDescriptor(**fields)


class TestDescriptors:
    def test_valid_descriptor(self) -> None:
        spec = TensorSpec.from_descriptor(descriptor())
        assert spec == TensorSpec("input_0", (2, 20, 3, 4), "float16", "chw16")
        assert spec.to_descriptor() == descriptor()

    @settings(max_examples=200, deadline=None)
    @given(spec=specs())
    def test_round_trip(self, spec: TensorSpec) -> None:
        assert TensorSpec.from_descriptor(spec.to_descriptor()) == spec

    def test_round_trip_drops_only_the_scale(self) -> None:
        spec = TensorSpec("q", (1, 3, 2, 2), "int8", "hwc4", scale=0.5)
        assert TensorSpec.from_descriptor(spec.to_descriptor()) == spec.with_scale(None)

    @pytest.mark.parametrize(
        ("changes", "words"),
        [
            (dict(data_type=0), r"dataType 0 is not a DLA element type"),
            (dict(data_type=9), r"dataType 9 is not a DLA element type"),
            (dict(data_format=0), r"dataFormat UNKNOWN"),
            (dict(data_format=7), r"dataFormat 7 is unknown"),
            (dict(stride=(32, 128, 384, 768, 0, 0, 1, 0)), r"stride\[4:8\] must be zero"),
            (dict(stride=(32, 128, 384, 768)), r"stride\[4:8\] must be zero"),
            (dict(pixel_mapping=1), r"pixelMapping 1 \(block linear\)"),
            (
                dict(stride=(48, 192, 576, 1152, 0, 0, 0, 0)),
                r"NCxHWx needs 16 or 32 lanes.*stride\[0\]=48",
            ),
            (
                dict(stride=(31, 124, 372, 744, 0, 0, 0, 0)),
                r"NCxHWx needs 16 or 32 lanes.*stride\[0\]=31",
            ),
            (
                dict(data_type=int(DataType.INT16)),
                r"does not accept int16 \(dataType 3\) in format chw16",
            ),
            (
                dict(
                    data_type=int(DataType.FLOAT),
                    stride=(64, 256, 768, 1536, 0, 0, 0, 0),
                    size=3072,
                ),
                r"does not accept float32 \(dataType 1\) in format chw16",
            ),
            (
                dict(stride=(32, 127, 384, 768, 0, 0, 0, 0)),
                r"stride\[1\] \(line stride\) 127 < w \* stride\[0\] = 4 \* 32 = 128",
            ),
            (
                dict(stride=(32, 128, 383, 768, 0, 0, 0, 0)),
                r"stride\[2\] \(surface stride\) 383 < h \* stride\[1\]",
            ),
            (
                dict(stride=(32, 128, 384, 767, 0, 0, 0, 0)),
                r"stride\[3\] \(batch stride\) 767 < 2 channel group\(s\) \* stride\[2\] = 768",
            ),
            (dict(size=2 * 768 - 1), r"size 1535 bytes < the 1536 bytes the layout spans"),
            (dict(size=0), r"size 0 bytes <"),
            (dict(n=0), r"shape must be four dimensions >= 1"),
            (dict(c=0), r"shape must be four dimensions >= 1"),
            (dict(h=0), r"shape must be four dimensions >= 1"),
            (dict(w=0), r"shape must be four dimensions >= 1"),
            (dict(name=""), r"name must be a non-empty string"),
            (dict(name="x" * 81), r"must be ASCII of at most 80 bytes"),
            (dict(name="é"), r"must be ASCII"),
            (
                dict(data_format=int(DataFormat.NCHW)),
                r"NCHW needs stride\[0\] == 2 \(one lane per pixel\), got 32",
            ),
            (
                dict(data_format=int(DataFormat.NCHW), stride=(0, 8, 24, 480, 0, 0, 0, 0)),
                r"stride\[0\] \(pixel stride\) 0 must be a positive multiple",
            ),
            (
                dict(data_format=int(DataFormat.NCHW), stride=(3, 12, 36, 720, 0, 0, 0, 0)),
                r"stride\[0\] \(pixel stride\) 3 must be a positive multiple of the 2-byte",
            ),
            (
                dict(data_format=int(DataFormat.NHWC), stride=(38, 152, 456, 912, 0, 0, 0, 0)),
                r"NHWC needs stride\[0\] >= c \* 2 = 40",
            ),
            (
                dict(
                    data_format=int(DataFormat.NHWC),
                    data_category=0,
                    data_type=int(DataType.UINT8),
                    c=20,
                    stride=(4, 16, 48, 96, 0, 0, 0, 0),
                ),
                r"hwc4 image input needs c in \(1, 3, 4\), got c=20",
            ),
            (
                dict(
                    data_format=int(DataFormat.NHWC),
                    data_category=0,
                    data_type=int(DataType.INT16),
                    c=3,
                    stride=(8, 32, 96, 192, 0, 0, 0, 0),
                    size=384,
                ),
                r"does not accept int16 \(dataType 3\) in format hwc4",
            ),
        ],
    )
    def test_inconsistent_descriptors(self, changes: dict[str, Any], words: str) -> None:
        desc = descriptor(**changes)
        with pytest.raises(ModelError, match=words) as caught:
            TensorSpec.from_descriptor(desc)
        message = str(caught.value)
        if desc.name and len(desc.name) <= 80 and desc.name.isascii():
            assert "'input_0'" in message
        if "from its cuDLA descriptor" in message:
            assert "stride [" in message
            assert f"size {desc.size}" in message

    def test_every_field_is_named_when_layout_fails(self) -> None:
        with pytest.raises(ModelError) as caught:
            TensorSpec.from_descriptor(descriptor(size=5))
        message = str(caught.value)
        for words in (
            "tensor 'input_0'",
            "size 5 bytes",
            "n c h w 2 20 3 4",
            "dataFormat 3",
            "dataType 2",
            "stride [32, 128, 384, 768, 0, 0, 0, 0]",
        ):
            assert words in message

    def test_hwc4_and_nhwc_by_category(self) -> None:
        image = descriptor(
            data_format=int(DataFormat.NHWC),
            data_category=0,
            data_type=int(DataType.UINT8),
            c=3,
            stride=(4, 16, 48, 96, 0, 0, 0, 0),
            size=192,
        )
        assert TensorSpec.from_descriptor(image).format == "hwc4"
        feature = descriptor(
            data_format=int(DataFormat.NHWC),
            data_category=2,
            data_type=int(DataType.UINT8),
            c=3,
            stride=(4, 16, 48, 96, 0, 0, 0, 0),
            size=192,
        )
        assert TensorSpec.from_descriptor(feature).format == "nhwc"
        gray = descriptor(
            data_format=int(DataFormat.NHWC),
            data_category=0,
            data_type=int(DataType.HALF),
            c=1,
            stride=(2, 8, 24, 48, 0, 0, 0, 0),
            size=96,
        )
        spec = TensorSpec.from_descriptor(gray)  # TensorRT's C == 1 image: one lane
        assert (spec.format, spec.lanes, spec.category) == ("nhwc", 1, 0)
        half_image = descriptor(
            data_format=int(DataFormat.NHWC),
            data_category=0,
            c=4,
            stride=(8, 32, 96, 192, 0, 0, 0, 0),
            size=384,
        )
        assert TensorSpec.from_descriptor(half_image).format == "hwc4"
        odd = descriptor(data_category=7)  # carried, not checked
        assert TensorSpec.from_descriptor(odd).category == 7

    def test_from_cudla_copies_every_field(self) -> None:
        class Record:
            name = np.frombuffer(b"abc\0" + bytes(77), np.int8)
            size_, n, c, h, w = 96, 1, 3, 2, 2
            data_format, data_type, data_category, pixel_format, pixel_mapping = 3, 2, 2, 36, 0
            stride = (32, 64, 128, 128, 0, 0, 0, 0)

        desc = TensorDescriptor.from_cudla(Record())
        assert desc.name == "abc"
        assert desc.stride == (32, 64, 128, 128, 0, 0, 0, 0)
        Record.name = b"xyz\0\0"  # type: ignore[assignment]
        assert TensorDescriptor.from_cudla(Record()).name == "xyz"
        Record.name = "uvw\0"  # type: ignore[assignment]
        assert TensorDescriptor.from_cudla(Record()).name == "uvw"
