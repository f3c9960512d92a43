"""onnx_compute: a reference ONNX network (convolution, activation, pooling) as the
emulated runtime's computation, through the Python API and the pytest plugin."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from aiodla import EmulatedRuntime, Engine, LoadableFormatError, ModelError, TensorSpec
from aiodla.emulator import make_loadable, onnx_compute, parse_loadable

onnx = pytest.importorskip("onnx", reason="needs onnx (the 'test' extra; no wheel here)")
ort = pytest.importorskip(
    "onnxruntime", reason="needs onnxruntime (aiodla[onnx]; no wheel for this Python)"
)
from onnx import TensorProto, helper  # noqa: E402

# Until the general op lands, an emulator loadable pairs input i with output i, of
# the same shape or NxCx1x1: the network keeps the shape (pooling with stride 1), and
# a second one pools globally.
IMAGE = TensorSpec("image", (1, 3, 16, 16), "float16", "chw16")
FEATURES = TensorSpec("features", (1, 3, 16, 16), "float16", "chw16")
POOLED = TensorSpec("pooled", (1, 3, 1, 1), "float16", "nchw")


def network(
    input_name: str = "image", output_name: str = "features", *, pooling: str = "MaxPool"
) -> bytes:
    """Conv 3->3 (3x3, pad 1) with bias, ReLU, then 3x3 max pooling with stride 1
    (1x3x16x16 -> 1x3x16x16), or global average pooling (-> 1x3x1x1)."""
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((3, 3, 3, 3)).astype(np.float32) * 0.3
    bias = rng.standard_normal(3).astype(np.float32) * 0.1
    if pooling == "MaxPool":
        pool = helper.make_node(
            "MaxPool", ["relu"], [output_name], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
        )
        out_shape = [1, 3, 16, 16]
    else:
        pool = helper.make_node("GlobalAveragePool", ["relu"], [output_name])
        out_shape = [1, 3, 1, 1]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", [input_name, "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["conv"], ["relu"]),
            pool,
        ],
        "tiny",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, out_shape)],
        initializer=[
            helper.make_tensor("w", TensorProto.FLOAT, weight.shape, weight.ravel()),
            helper.make_tensor("b", TensorProto.FLOAT, bias.shape, bias.ravel()),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def reference(data: bytes, x: np.ndarray[Any, Any], name: str = "image") -> np.ndarray[Any, Any]:
    """onnxruntime on the FP16-rounded input."""
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    rounded = x.astype(np.float16).astype(np.float32)
    (result,) = session.run(None, {name: rounded})
    return np.asarray(result)


def loadable(output: TensorSpec = FEATURES, input_: TensorSpec = IMAGE) -> bytes:
    op = "mean_hw" if output.shape[2:] == (1, 1) else "affine"
    return make_loadable([input_], [output], op, latency=0.002)


def images(count: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(11)
    return [rng.standard_normal(IMAGE.shape).astype(np.float32) for _ in range(count)]


def assert_fp16_close(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    assert got.dtype == np.float16
    # The engine stores the network's float32 result as FP16: half an FP16 ulp.
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2**-11, atol=1e-6)


@pytest.mark.asyncio
class TestThroughTheEngine:
    async def test_outputs_match_onnxruntime_on_rounded_inputs(self) -> None:
        data = network()
        runtime = EmulatedRuntime(compute=onnx_compute(data))
        xs = images(16)
        async with Engine(loadable(), runtime=runtime) as engine:
            ys = await asyncio.gather(*(engine.infer(x) for x in xs))
        for x, y in zip(xs, ys, strict=True):
            assert_fp16_close(y, reference(data, x))

    async def test_a_path_and_a_shape_changing_network(self, tmp_path: Any) -> None:
        path = tmp_path / "pooled.onnx"
        path.write_bytes(network(output_name="pooled", pooling="GlobalAveragePool"))
        runtime = EmulatedRuntime(compute=onnx_compute(path))
        x = images(1)[0]
        async with Engine(loadable(POOLED), runtime=runtime) as engine:
            y = await engine.infer(x)
        assert y.shape == (1, 3, 1, 1)
        assert_fp16_close(y, reference(path.read_bytes(), x))

    async def test_the_plugin(self, aiodla_engine: Any, aiodla_controls: Any) -> None:
        data = network()
        engine = await aiodla_engine(inputs=[IMAGE], outputs=[FEATURES], compute=onnx_compute(data))
        xs = images(8)
        ys = await asyncio.gather(*(engine.infer(x) for x in xs))
        for x, y in zip(xs, ys, strict=True):
            assert_fp16_close(y, reference(data, x))
        aiodla_controls.fail_next()  # the faults still apply around the network
        results = await asyncio.gather(*(engine.infer(x) for x in xs), return_exceptions=True)
        assert sum(isinstance(r, Exception) for r in results) == 1

    async def test_names_can_be_mapped(self) -> None:
        data = network(input_name="input.1", output_name="191")
        compute = onnx_compute(data, names={"image": "input.1", "features": "191"})
        x = images(1)[0]
        async with Engine(loadable(), runtime=EmulatedRuntime(compute=compute)) as engine:
            assert_fp16_close(await engine.infer(x), reference(data, x, "input.1"))


@pytest.mark.asyncio
class TestCheckedAtOpen:
    async def test_a_missing_name(self) -> None:
        compute = onnx_compute(network(input_name="data"))
        engine = Engine(loadable(), runtime=EmulatedRuntime(compute=compute))
        with pytest.raises(ModelError, match=r"input 'image' has no ONNX input 'image'.*'data'"):
            await engine.open()

    async def test_a_shape_that_does_not_fit(self) -> None:
        wide = TensorSpec("image", (1, 3, 32, 32), "float16", "chw16")
        out = TensorSpec("features", (1, 3, 32, 32), "float16", "chw16")
        engine = Engine(
            loadable(out, wide), runtime=EmulatedRuntime(compute=onnx_compute(network()))
        )
        with pytest.raises(ModelError, match=r"shape \[1, 3, 16, 16\].*\(1, 3, 32, 32\)"):
            await engine.open()


def test_bytes_that_are_not_onnx() -> None:
    with pytest.raises(ModelError, match="onnxruntime cannot load"):
        onnx_compute(b"not a network")


def test_called_directly_it_runs_by_onnx_names() -> None:
    data = network()
    x = images(1)[0]
    result = onnx_compute(data)({"image": x})
    np.testing.assert_allclose(result["features"], reference(data, x.astype(np.float32)), rtol=1e-2)


class TestCarriedByTheLoadable:
    """An emulator loadable that carries its ONNX network computes with it, untrusted."""

    def test_the_piece_round_trips(self) -> None:
        data = network()
        model = parse_loadable(make_loadable([IMAGE], [FEATURES], "mix", onnx=data))
        assert model.onnx == data
        assert model.compute is None

    @pytest.mark.asyncio
    async def test_the_engine_runs_it_without_trust(self) -> None:
        data = network()
        x = images(1)[0]
        async with Engine(make_loadable([IMAGE], [FEATURES], "mix", onnx=data)) as engine:
            assert_fp16_close(await engine.infer(x), reference(data, x))

    def test_a_reference_and_a_network_together_are_refused(self) -> None:
        with pytest.raises(ModelError, match="not both"):
            make_loadable([IMAGE], [FEATURES], "mix", compute="m:f", onnx=network())

    def test_an_empty_network_is_refused(self) -> None:
        with pytest.raises(ModelError, match="non-empty bytes"):
            make_loadable([IMAGE], [FEATURES], "mix", onnx=b"")
        good = make_loadable([IMAGE], [FEATURES], "mix", onnx=network())
        header = bytearray(good[:64])
        bare = len(good) - len(network())  # records plus the 5-byte mark
        header[40:48] = bare.to_bytes(8, "little")
        header[48:56] = (5).to_bytes(8, "little")
        with pytest.raises(LoadableFormatError, match="the ONNX piece is empty"):
            parse_loadable(bytes(header) + good[64:bare])

    @pytest.mark.asyncio
    async def test_weights_in_an_external_file_are_refused(self) -> None:
        from onnx.external_data_helper import set_external_data

        model = onnx.load_from_string(network())
        weight = model.graph.initializer[0]
        weight.raw_data = np.asarray(weight.float_data, np.float32).tobytes()
        del weight.float_data[:]
        set_external_data(weight, location="w.bin")
        weight.data_location = onnx.TensorProto.EXTERNAL
        weight.ClearField("raw_data")
        data = model.SerializeToString()
        with pytest.raises(ModelError, match="external file"):
            async with Engine(make_loadable([IMAGE], [FEATURES], "mix", onnx=data)):
                pass

    @pytest.mark.asyncio
    async def test_bytes_that_are_not_onnx_fail_the_open(self) -> None:
        with pytest.raises(ModelError, match="not a readable model"):
            async with Engine(make_loadable([IMAGE], [FEATURES], "mix", onnx=b"junk")):
                pass
