"""The emulator loadable: round trips, the C layout, and hostile bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cuda.bindings import cudla
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodla import LoadableFormatError, ModelError, TensorSpec
from aiodla.emulator import is_emulator_loadable, make_loadable, parse_loadable
from aiodla.emulator._format import DESCRIPTOR_DTYPE, HEADER_SIZE, RECORD_SIZE

A = TensorSpec("input_a", (1, 3, 8, 8), "float16", "chw16")
B = TensorSpec("out_b", (1, 3, 8, 8), "float32", "nchw")
M = TensorSpec("mean_b", (1, 3, 1, 1), "float32", "nchw")


def test_round_trip() -> None:
    data = make_loadable([A], [B], "affine", 0.0025, scale=1.5, bias=-2.0)
    assert is_emulator_loadable(data)
    model = parse_loadable(data)
    assert model.inputs == (A,) and model.outputs == (B,)
    assert (model.op, model.latency, model.scale, model.bias) == ("affine", 0.0025, 1.5, -2.0)
    assert len(data) == HEADER_SIZE + 16 + 2 * RECORD_SIZE


def test_records_are_cudla_tensor_descriptors() -> None:
    """Byte for byte what C's cudlaModuleTensorDescriptor is, as the bindings see it."""
    assert cudla.module_tensor_descriptor_dtype == DESCRIPTOR_DTYPE
    data = make_loadable([A], [M], "mean_hw", 0.001)
    records = np.frombuffer(
        data, dtype=cudla.module_tensor_descriptor_dtype, count=2, offset=HEADER_SIZE + 16
    )
    assert bytes(records[0]["name"].view(np.uint8)).rstrip(b"\0") == b"input_a"
    assert (int(records[0]["c"]), int(records[0]["data_format"]), int(records[0]["data_type"])) == (
        3,
        3,
        2,
    )
    assert list(records[0]["stride"][:4]) == [32, 256, 2048, 2048]
    assert int(records[1]["size_"]) == 12


def test_header_layout() -> None:
    data = make_loadable([A], [B], "affine", 0.5)
    magic, version, header, n_in, n_out, op, params = struct.unpack_from("<8s6I", data)
    assert (magic, version, header, n_in, n_out, op, params) == (b"AIODLAEM", 1, 64, 1, 1, 1, 2)
    assert struct.unpack_from("<dQ", data, 32) == (0.5, len(data))


@pytest.mark.parametrize(
    ("inputs", "outputs", "op", "words"),
    [
        ([A], [B], "conv", "op 'conv' is unknown"),
        ([A], [], "affine", "needs at least one input and one output"),
        ([], [B], "mix", "needs at least one input and one output"),
        ([A], [B, M], "affine", "pairs input i with output i"),
        ([A], [B, M], "mean_hw", "pairs input i with output i"),
        ([A], [M], "affine", "must have shape (1, 3, 8, 8)"),
        ([A], [B], "mean_hw", "must have shape (1, 3, 1, 1)"),
        ([A], [A], "affine", "appears twice"),
    ],
)
def test_make_rejects_inconsistent_models(
    inputs: list[TensorSpec], outputs: list[TensorSpec], op: str, words: str
) -> None:
    with pytest.raises(ModelError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make_loadable(inputs, outputs, op)


@pytest.mark.parametrize("latency", [-1.0, float("inf"), float("nan"), 4000.0])
def test_make_rejects_bad_latency(latency: float) -> None:
    with pytest.raises(ModelError, match="latency"):
        make_loadable([A], [B], "affine", latency)


def test_make_rejects_non_specs() -> None:
    with pytest.raises(TypeError, match="TensorSpec"):
        make_loadable(["x"], [B])  # type: ignore[list-item]


def mutate(data: bytes, offset: int, fmt: str, value: object) -> bytes:
    buffer = bytearray(data)
    struct.pack_into(fmt, buffer, offset, value)
    return bytes(buffer)


GOOD = make_loadable([A], [B], "affine", 0.001)
NAME_AT = HEADER_SIZE + 16


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "shorter than the 64-byte header"),
        (GOOD[:63], "shorter"),
        (b"XXXXXXXX" + GOOD[8:], "bad magic"),
        (mutate(GOOD, 8, "<I", 2), "version 2"),
        (mutate(GOOD, 12, "<I", 32), "header_size"),
        (mutate(GOOD, 16, "<I", 0), "tensor counts"),
        (mutate(GOOD, 16, "<I", 0xFFFFFFFF), "tensor counts"),
        (mutate(GOOD, 20, "<I", 1000), "tensor counts"),
        (mutate(GOOD, 24, "<I", 9), "op code 9"),
        (mutate(GOOD, 28, "<I", 1 << 30), "param_count"),
        (mutate(GOOD, 32, "<d", float("nan")), "latency"),
        (mutate(GOOD, 40, "<Q", 1 << 62), "total_size"),
        (mutate(GOOD, 48, "<Q", 1), "total_size"),  # a compute reference it lacks
        (mutate(GOOD, 48, "<Q", 1 << 40), "compute_size"),
        (mutate(GOOD, 56, "<Q", 1), "reserved"),
        (GOOD[:-1], "truncated"),
        (GOOD + b"\0", "truncated or padded"),
        (mutate(GOOD, HEADER_SIZE, "<d", float("inf")), "finite"),
        (mutate(GOOD, NAME_AT, "<81s", b"x" * 81), "NUL-terminated"),
        (mutate(GOOD, NAME_AT, "<1s", b"\0"), "1-80 printable"),
        (mutate(GOOD, NAME_AT, "<2s", b"a\x07"), "1-80 printable"),
        (mutate(GOOD, NAME_AT + 104, "<Q", 1 << 40), "beyond any DLA tensor"),
        (mutate(GOOD, NAME_AT + 88, "<Q", 1 << 60), "beyond any DLA tensor"),
        (mutate(GOOD, NAME_AT + RECORD_SIZE, "<8s", b"input_a\0"), "appears twice"),
    ],
)
def test_parse_rejects_hostile_bytes(data: bytes, words: str) -> None:
    with pytest.raises(LoadableFormatError, match=words.replace("(", r"\(")):
        parse_loadable(data)


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "words"),
    [
        (NAME_AT + 88, "<Q", 16, "size 16 bytes <"),  # smaller than the layout
        (NAME_AT + 129, "<B", 9, "dataType 9"),
        (NAME_AT + 128, "<B", 7, "dataFormat 7"),
        (NAME_AT + 136 + 16, "<I", 5, "stride[4:8] must be zero"),
        (NAME_AT + 136, "<I", 6, "stride[0]"),
        (NAME_AT + 132, "<B", 1, "block linear"),
    ],
)
def test_parse_rejects_inconsistent_descriptors(
    offset: int, fmt: str, value: int, words: str
) -> None:
    with pytest.raises(ModelError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_loadable(mutate(GOOD, offset, fmt, value))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_never_crash(data: bytes) -> None:
    try:
        parse_loadable(data)
    except ModelError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(GOOD) - 1), st.integers(0, 255))
def test_any_single_byte_change_is_parsed_or_refused(position: int, value: int) -> None:
    data = bytearray(GOOD)
    data[position] = value
    try:
        model = parse_loadable(bytes(data))
    except ModelError:
        return
    assert len(model.inputs) == len(model.outputs) == 1


def test_make_refuses_a_tensor_whose_strides_outgrow_the_format() -> None:
    # 64 planes of 4096x4096 float32: the batch stride is 2**32 bytes, one past uint32.
    big = TensorSpec("frames", (2, 64, 4096, 4096), "float32", "nchw")
    out = TensorSpec("y", (2, 64, 4096, 4096), "float32", "nchw")
    with pytest.raises(ModelError, match=r"tensor 'frames': stride\[3\] = 4294967296 .* uint32"):
        make_loadable([big], [out])
