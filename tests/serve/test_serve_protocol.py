"""``aiodla serve`` through Triton's own clients: health, metadata, and inference
checked byte for byte against ``Engine.infer`` on the same engine and input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from clients import KINDS, Client
from conftest import SCALES, sample

from aiodla import Engine
from aiodla.serve import Server

pytestmark = pytest.mark.asyncio

# (client kind, binary): gRPC always sends raw bytes.
WAYS = [
    ("http", True),
    ("http", False),
    ("http_aio", True),
    ("http_aio", False),
    ("grpc", True),
    ("grpc_aio", True),
]
MODELS = ("affine", "pair", "int8", "uint8")


def as_dict(engine: Engine, result: Any) -> dict[str, Any]:
    return result if isinstance(result, dict) else {engine.outputs[0].name: result}


@pytest.mark.parametrize("kind", KINDS)
async def test_health_and_server_metadata(server: Server, kind: str) -> None:
    client = Client(kind, server)
    assert await client.call("is_server_live")
    assert await client.call("is_server_ready")
    assert await client.call("is_model_ready", "affine")
    meta = await client.call("get_server_metadata")
    if not client.http:
        meta = {"name": meta.name, "extensions": list(meta.extensions)}
    assert meta["name"] == "aiodla"
    assert "binary_tensor_data" in meta["extensions"]


@pytest.mark.parametrize("kind", KINDS)
async def test_model_metadata(server: Server, kind: str) -> None:
    client = Client(kind, server)
    pair = await client.metadata("pair")
    assert pair["name"] == "pair" and pair["platform"] == "aiodla" and pair["versions"] == ["1"]
    assert [(t["name"], t["datatype"], t["shape"]) for t in pair["inputs"]] == [
        ("a", "FP16", [1, 4, 6, 6]),
        ("b", "FP32", [2, 3, 5, 7]),
    ]
    assert [(t["name"], t["datatype"], t["shape"]) for t in pair["outputs"]] == [
        ("mean_a", "FP32", [1, 4, 1, 1]),
        ("mean_b", "FP16", [2, 3, 1, 1]),
    ]
    quantized = await client.metadata("int8")
    # The input takes INT8; the output comes back as Engine.infer returns it: scale * r.
    assert [t["datatype"] for t in quantized["inputs"]] == ["INT8"]
    assert [t["datatype"] for t in quantized["outputs"]] == ["FP32"]
    assert [t["datatype"] for t in (await client.metadata("uint8"))["outputs"]] == ["UINT8"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("kind", "binary"), WAYS)
async def test_inference_is_engine_infer_byte_for_byte(
    server: Server, engines: dict[str, Engine], kind: str, binary: bool, model: str
) -> None:
    engine = engines[model]
    arrays = {spec.name: sample(spec, seed) for seed, spec in enumerate(engine.inputs)}
    expected = as_dict(engine, await engine.infer(arrays))
    got, ident = await Client(kind, server).infer(model, arrays, binary=binary, request_id="req-7")
    assert ident == "req-7"
    assert list(got) == [spec.name for spec in engine.outputs]
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert got[name].tobytes() == want.tobytes(), name


@pytest.mark.parametrize(("kind", "binary"), WAYS)
async def test_outputs_asked_for_by_name(
    server: Server, engines: dict[str, Engine], kind: str, binary: bool
) -> None:
    engine = engines["pair"]
    arrays = {spec.name: sample(spec, 3) for spec in engine.inputs}
    expected = await engine.infer(arrays)
    got, _ = await Client(kind, server).infer("pair", arrays, binary=binary, outputs=["mean_b"])
    assert list(got) == ["mean_b"]
    assert got["mean_b"].tobytes() == expected["mean_b"].tobytes()


@pytest.mark.parametrize("kind", ["http", "grpc_aio"])
async def test_floats_into_a_quantized_input_are_quantized_as_engine_infer_does(
    server: Server, engines: dict[str, Engine], kind: str
) -> None:
    engine = engines["int8"]
    x = (np.random.default_rng(5).standard_normal((1, 4, 4, 4)) * 3).astype(np.float32)
    expected = await engine.infer(x)
    got, _ = await Client(kind, server).infer("int8", {"q": x})
    assert got["r"].tobytes() == expected.tobytes()
    assert engine.inputs[0].scale == SCALES["q"]


async def test_http_binary_and_json_inputs_mixed_in_one_request(
    server: Server, engines: dict[str, Engine]
) -> None:
    import tritonclient.http as thttp

    engine = engines["pair"]
    arrays = {spec.name: sample(spec, 9) for spec in engine.inputs}
    a = thttp.InferInput("a", [1, 4, 6, 6], "FP16")
    a.set_data_from_numpy(arrays["a"], binary_data=False)
    b = thttp.InferInput("b", [2, 3, 5, 7], "FP32")
    b.set_data_from_numpy(arrays["b"], binary_data=True)
    outputs = [
        thttp.InferRequestedOutput("mean_a", binary_data=False),
        thttp.InferRequestedOutput("mean_b"),
    ]
    client = thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        import asyncio

        result = await asyncio.to_thread(client.infer, "pair", [a, b], outputs=outputs)
    finally:
        client.close()
    expected = await engine.infer(arrays)
    response = result.get_response()
    assert "data" in response["outputs"][0] and "parameters" in response["outputs"][1]
    for name in ("mean_a", "mean_b"):
        assert result.as_numpy(name).tobytes() == expected[name].tobytes()


async def test_grpc_typed_contents(server: Server, engines: dict[str, Engine]) -> None:
    """Inputs in InferTensorContents (tritonclient's own messages, against our .proto)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    rows = []
    for model, field in (("uint8", "uint_contents"), ("int8", "int_contents")):
        engine = engines[model]
        spec = engine.inputs[0]
        x = sample(spec, 11)
        request = service_pb2.ModelInferRequest(model_name=model, id="t")
        tensor = request.inputs.add(
            name=spec.name, datatype=x.dtype.name.upper().replace("UINT", "UINT"), shape=spec.shape
        )
        tensor.datatype = {"uint8": "UINT8", "int8": "INT8"}[x.dtype.name]
        getattr(tensor.contents, field).extend(x.ravel().tolist())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            response = await stub.ModelInfer(request)
        expected = await engine.infer(x)
        assert response.id == "t" and response.outputs[0].name == engine.outputs[0].name
        rows.append((response.raw_output_contents[0], expected.tobytes()))
    for got, want in rows:
        assert got == want


async def test_metrics_carry_triton_and_aiodla_families(
    server: Server, engines: dict[str, Engine]
) -> None:
    import aiohttp

    x = sample(engines["affine"].inputs[0])
    await Client("http_aio", server).infer("affine", {"x": x})
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{server.http_port}/metrics") as response,
    ):
        assert response.status == 200
        text = await response.text()
    assert 'nv_inference_request_success{model="affine",version="1"} 1.0' in text
    assert 'aiodla_request_success_total{engine="affine"} 1.0' in text
