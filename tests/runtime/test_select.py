"""Choosing a runtime: files that are models of another kind are named as such."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from aiodla import Engine, ModelError, _cli
from aiodla.runtime._select import foreign_model

from support import affine_model


def field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (all lengths here fit one varint byte)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


# A minimal ONNX ModelProto, as torch.onnx.export starts one: ir_version 8 (field 1,
# varint), producer_name (2), a graph (7) holding its name (2), opset_import (8)
# holding version 17 (field 2, varint).
ONNX = (
    bytes([1 << 3, 8])
    + field(2, b"pytorch")
    + field(7, field(2, b"main_graph"))
    + field(8, bytes([2 << 3, 17]))
)
# A TensorRT plan starts with its magic tag; Ultralytics' .engine puts a JSON
# header (its length as 4 little-endian bytes) in front of one.
TRT_PLAN = b"ftrt" + bytes(60)
ULTRALYTICS_ENGINE = len(b'{"imgsz": 640}').to_bytes(4, "little") + b'{"imgsz": 640}' + TRT_PLAN


class TestRecognised:
    def test_onnx(self) -> None:
        assert foreign_model(ONNX) == "an ONNX model"

    @pytest.mark.parametrize("data", [TRT_PLAN, ULTRALYTICS_ENGINE], ids=["plan", "ultralytics"])
    def test_tensorrt_engines(self, data: bytes) -> None:
        assert foreign_model(data) == "a TensorRT engine (plan) file"

    @pytest.mark.parametrize(
        "data",
        [
            affine_model(),
            b"",
            ONNX[:-1],  # cut short: the last field's length runs past the end
            ONNX + b"\x00",  # field number 0 does not exist
            bytes([1 << 3, 8]) + field(2, b"pytorch"),  # no graph
            b"\x01\x02NVDLA-loadable",
        ],
        ids=["emulator", "empty", "cut", "trailing", "no-graph", "other"],
    )
    def test_others_are_not(self, data: bytes) -> None:
        assert foreign_model(data) is None

    def test_random_bytes_are_not(self) -> None:
        assert all(foreign_model(os.urandom(256)) is None for _ in range(2000))


class TestRefused:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("runtime", ["auto", "emulated", "cuda"])
    async def test_an_onnx_file_says_how_to_build_a_loadable(self, runtime: str) -> None:
        with pytest.raises(ModelError) as caught:
            await Engine(ONNX, runtime=runtime).open()
        message = str(caught.value)
        assert message.startswith("the model is an ONNX model, not a DLA loadable")
        assert "trtexec --onnx=model.onnx --useDLACore=0 --buildDLAStandalone" in message
        assert "--inputIOFormats=fp16:chw16" in message
        assert "cuDLA" not in message.partition(";")[0]

    @pytest.mark.asyncio
    async def test_a_tensorrt_engine_says_it_is_not_standalone(self) -> None:
        with pytest.raises(ModelError, match=r"TensorRT engine .*--buildDLAStandalone"):
            await Engine(TRT_PLAN, runtime="auto").open()

    def test_inspect_names_the_file(self, tmp_path: Path) -> None:
        path = tmp_path / "model.onnx"
        path.write_bytes(ONNX)
        result = CliRunner().invoke(_cli.cli, ["inspect", str(path)])
        assert result.exit_code == 1
        assert f"{str(path)!r} is an ONNX model, not a DLA loadable" in result.output
        assert "--buildDLAStandalone" in result.output
