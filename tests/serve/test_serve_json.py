"""The HTTP front's JSON: the piecewise parser and writer that keep large tensors off
the event loop, the value types Triton takes, ``"outputs": []``, and JSON for every
error, routes not served included, and the model configuration tritonclient reads."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import numpy as np
import pytest
from clients import Client, failure
from conftest import sample

from aiodla import Engine, TensorSpec
from aiodla.serve import Server, _kserve

HTTP_KINDS = ("http", "http_aio")


def _json() -> Any:
    from aiodla.serve import _json

    return _json


async def http(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{server.http_port}{path}"
    data = None if body is None else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, data=data) as response,
    ):
        assert response.content_type == "application/json", await response.text()
        return response.status, await response.json()


class TestChunkedJson:
    """The piecewise parser and writer give exactly what the standard library gives."""

    @pytest.mark.parametrize(
        "text",
        [
            "[]",
            "[ ]",
            "[1, 2.5, -3e2]",
            "[[1,2],[3,4]]",
            '{"a": [1, 2], "b": "[1,2]", "c": {"d": []}}',
            "[1, NaN, Infinity, true, null]",
            "[" + ",".join(str(i) for i in range(100_000)) + "]",
            "[" + ", ".join(str(i / 7) for i in range(50_000)) + ", \n 2 ]",
            "[[" + ",".join(str(i) for i in range(100_000)) + "], [1]]",
        ],
        ids=lambda text: text[:16],
    )
    def test_same_values(self, text: str) -> None:
        assert json.dumps(_json().loads(text.encode())) == json.dumps(json.loads(text))

    @pytest.mark.parametrize(
        "text",
        [
            "[1,]",
            "[1 2]",
            "[012]",
            "[1,,2]",
            "[1,2",
            "[" + ",".join(str(i) for i in range(100_000)) + ",]",
            "[" + ",".join(str(i) for i in range(100_000)) + ", ]",
            "[" + ",".join(str(i) for i in range(100_000)) + ",,1]",
            "[" + ",".join(str(i) for i in range(100_000)) + ",1 2]",
        ],
        ids=lambda text: text[:8] + text[-8:],
    )
    def test_same_refusals(self, text: str) -> None:
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)
        with pytest.raises(json.JSONDecodeError):
            _json().loads(text.encode())

    def test_values_written_as_json_dumps_writes_them(self) -> None:
        rng = np.random.default_rng(2)
        for value in (
            rng.standard_normal(10_000).astype(np.float32),
            rng.integers(-128, 128, (3, 5000)).astype(np.int8),
            np.array([True, False]),
            np.zeros(0, np.float16),
        ):
            want = json.dumps(value.ravel().tolist(), separators=(",", ":"))
            assert _json().dumps_values(value) == want


# -- values of the datatype ------------------------------------------------------------------


def test_request_limit_follows_the_models() -> None:
    wire = _kserve.wire_input
    small = [wire(TensorSpec("a", (1, 4, 6, 6), "float16", "chw16"))]
    assert _kserve.request_limit([small]) == 1024 * 1024  # the floor
    two = [
        wire(TensorSpec("x", (1, 3, 320, 320), "float32", "nchw")),
        wire(TensorSpec("b", (1, 1, 320, 320), "float16", "nchw")),
    ]
    limit = _kserve.request_limit([small, two])
    elements = 4 * 320 * 320
    assert elements * 24 < limit < elements * 40  # JSON's bytes per value, and slack
    # A one-byte datatype's values are short ("255, "): a UINT8 frame takes 12 a value.
    frame = [_kserve.WireTensor("f", ("UINT8",), (-1, -1, 3), 1080 * 1920 * 3)]
    assert _kserve.request_limit([frame]) == 1080 * 1920 * 3 * 12 + _kserve.HEADER_SLACK


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("model", "name", "datatype", "bad"),
    [
        ("int8", "q", "INT8", 1.7),
        ("int8", "q", "INT8", "5"),
        ("int8", "q", "INT8", 2.0),
        ("int8", "q", "INT8", True),
        ("uint8", "image", "UINT8", 0.5),
        ("uint8", "image", "UINT8", -1),
        ("affine", "x", "FP16", "1.5"),
        ("affine", "x", "FP16", False),
    ],
)
async def test_json_values_of_the_wrong_type_are_refused(
    server: Server, model: str, name: str, datatype: str, bad: object
) -> None:
    """As Triton: integers for an integer datatype, numbers for a float one; 400 naming
    the input, never a silent cast (1.7 to 1, "5" to 5)."""
    spec = server.models[model].inputs[name].spec
    assert spec is not None
    data: list[Any] = sample(spec).ravel().tolist()
    data[3] = bad
    request = {"inputs": [{"name": name, "datatype": datatype, "shape": spec.shape, "data": data}]}
    status, answer = await http(server, "POST", f"/v2/models/{model}/infer", request)
    assert status == 400, answer
    assert f"input {name!r}" in answer["error"] and datatype in answer["error"]


@pytest.mark.asyncio
async def test_json_integers_into_a_float_input(server: Server, engines: dict[str, Engine]) -> None:
    x = np.arange(192, dtype=np.float16).reshape(1, 3, 8, 8)
    data = [int(v) for v in x.ravel()]  # JSON integers: a float input takes them
    request = {"inputs": [{"name": "x", "datatype": "FP16", "shape": [1, 3, 8, 8], "data": data}]}
    status, answer = await http(server, "POST", "/v2/models/affine/infer", request)
    assert status == 200, answer
    want = await engines["affine"].infer(x)
    assert np.asarray(answer["outputs"][0]["data"], np.float32).tobytes() == want.tobytes()


def test_bool_takes_only_booleans() -> None:
    spec = TensorSpec("b", (1, 4, 1, 1), "uint8", "nchw")
    # No DLA tensor is BOOL: the rule is checked on the codec, as a BOOL tensor meets it.
    assert _kserve._typed(np.asarray([True, False]), np.dtype(bool)).dtype == np.bool_
    for bad in ([1, 0], [0.0, 1.0], ["true", "false"]):
        with pytest.raises(ValueError, match="true or false"):
            _kserve._typed(np.asarray(bad), np.dtype(bool))
    with pytest.raises(_kserve.ProtocolError, match=r"'b'.*UINT8.*integers"):
        _kserve.decode_json(_kserve.wire_input(spec), "UINT8", [1, 4, 1, 1], [1, 2, 3, 4.5])


# -- outputs, errors, configuration ------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_empty_outputs_list_asks_for_all(
    server: Server, engines: dict[str, Engine]
) -> None:
    engine = engines["pair"]
    arrays = {spec.name: sample(spec, 4) for spec in engine.inputs}
    request = {
        "inputs": [
            {
                "name": n,
                "datatype": "FP16" if n == "a" else "FP32",
                "shape": list(a.shape),
                "data": a.ravel().tolist(),
            }
            for n, a in arrays.items()
        ],
        "outputs": [],
    }
    status, answer = await http(server, "POST", "/v2/models/pair/infer", request)
    assert status == 200, answer
    assert [o["name"] for o in answer["outputs"]] == ["mean_a", "mean_b"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("method", "path", "code"),
    [
        ("GET", "/v2/nowhere", 404),
        ("GET", "/v2/models/affine/stats", 404),
        ("POST", "/v2/repository/index", 404),
        ("POST", "/v2/health/live", 405),
        ("GET", "/v2/models/affine/infer", 405),
    ],
)
async def test_routes_not_served_answer_json(
    server: Server, method: str, path: str, code: int
) -> None:
    status, answer = await http(server, method, path)
    assert status == code and f"{method} {path} is not served" in answer["error"]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", HTTP_KINDS)
async def test_unimplemented_http_calls_fail_as_tritonclient_errors(
    server: Server, kind: str
) -> None:
    client = Client(kind, server)
    for call in (("get_inference_statistics", "affine"), ("get_model_repository_index",)):
        exc = await failure(client.call(*call))
        # Before: "an exception occurred in the client while decoding the response".
        assert str(exc.status()) == "404", exc
        assert "is not served" in exc.message() and "decoding" not in exc.message()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", HTTP_KINDS)
async def test_model_config_over_http(server: Server, kind: str) -> None:
    config = await Client(kind, server).call("get_model_config", "pair")
    assert config == {
        "name": "pair",
        "platform": "aiodla",
        "backend": "aiodla",
        "max_batch_size": 0,
        "input": [
            {"name": "a", "data_type": "TYPE_FP16", "dims": [1, 4, 6, 6]},
            {"name": "b", "data_type": "TYPE_FP32", "dims": [2, 3, 5, 7]},
        ],
        "output": [
            {"name": "mean_a", "data_type": "TYPE_FP32", "dims": [1, 4, 1, 1]},
            {"name": "mean_b", "data_type": "TYPE_FP16", "dims": [2, 3, 1, 1]},
        ],
    }
    quantized = await Client(kind, server).call("get_model_config", "int8")
    assert [t["data_type"] for t in quantized["input"] + quantized["output"]] == [
        "TYPE_INT8",
        "TYPE_FP32",
    ]
    exc = await failure(Client(kind, server).call("get_model_config", "nope"))
    assert str(exc.status()) == "404" and "nope" in exc.message()
