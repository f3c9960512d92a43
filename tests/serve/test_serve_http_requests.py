"""HTTP inference requests field by field, read off the wire: the answer's model name and
version, ``binary_data_output`` for outputs listed without parameters, and the exact
message of each malformed field (what a client's author reads to fix a request)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import numpy as np
import pytest

from aiodla.serve import Server

from support import X, expected_affine

pytestmark = pytest.mark.asyncio

HEADER_LENGTH = "Inference-Header-Content-Length"
XS = (np.arange(np.prod(X.shape)).reshape(X.shape) / 8).astype(np.float16)
TENSOR = {"name": "x", "datatype": "FP16", "shape": list(X.shape)}


async def post(
    server: Server, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    url = f"http://127.0.0.1:{server.http_port}/v2/models/affine/infer"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=headers) as response,
    ):
        return response.status, dict(response.headers), await response.read()


def request(**fields: Any) -> bytes:
    return json.dumps({"inputs": [{**TENSOR, "data": XS.ravel().tolist()}], **fields}).encode()


async def test_the_answer_names_the_model_and_its_version(server: Server) -> None:
    status, _, body = await post(server, request(outputs=[{"name": "y"}]))
    assert status == 200, body
    answer = json.loads(body)
    assert (answer["model_name"], answer["model_version"]) == ("affine", "1")
    (output,) = answer["outputs"]
    y = np.asarray(output["data"], np.float32).reshape(output["shape"])
    np.testing.assert_array_equal(y, expected_affine(XS))


async def test_binary_data_output_covers_outputs_listed_without_parameters(
    server: Server,
) -> None:
    body = request(outputs=[{"name": "y"}], parameters={"binary_data_output": True})
    status, headers, answer = await post(server, body)
    assert status == 200, answer
    length = int(headers[HEADER_LENGTH])
    (output,) = json.loads(answer[:length])["outputs"]
    assert output["parameters"]["binary_data_size"] == len(answer) - length
    y = np.frombuffer(answer[length:], np.float32).reshape(output["shape"])
    np.testing.assert_array_equal(y, expected_affine(XS))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"parameters": {"binary_data_output": "yes"}},
            "parameter 'binary_data_output' must be true or false",
        ),
        ({"outputs": {"name": "y"}}, "'outputs' must be a list"),
        ({"outputs": [5]}, "'outputs[]' must be a JSON object"),
        ({"outputs": [{"name": "y", "parameters": 5}]}, "'parameters' must be a JSON object"),
    ],
)
async def test_a_malformed_field_is_400_naming_it(
    server: Server, fields: dict[str, Any], message: str
) -> None:
    status, _, body = await post(server, request(**fields))
    assert status == 400 and json.loads(body) == {"error": message}


async def test_a_json_number_beyond_float64_is_400(server: Server) -> None:
    data = ["1e400", *map(str, XS.ravel().tolist()[1:])]
    tensor = json.dumps(TENSOR)[:-1] + ', "data": [' + ", ".join(data) + "]}"
    status, _, body = await post(server, b'{"inputs": [' + tensor.encode() + b"]}")
    assert status == 400
    assert json.loads(body) == {
        "error": "input 'x': NaN or infinity (NaN, Infinity or a number beyond float64's "
        "range) is not a JSON number; send such values as binary data"
    }


async def test_a_non_finite_output_asked_as_json_says_to_ask_for_binary(server: Server) -> None:
    x = XS.copy()
    x[0, 0, 0, 0] = np.inf  # an input sent as binary data may hold it; y = 2x + 0.5
    header = json.dumps(
        {"inputs": [{**TENSOR, "parameters": {"binary_data_size": x.nbytes}}]}
    ).encode()
    status, _, body = await post(server, header + x.tobytes(), {HEADER_LENGTH: str(len(header))})
    assert status == 500
    assert json.loads(body) == {
        "error": "an output holds NaN or infinity, which JSON cannot carry; ask for it as "
        "binary data (binary_data_output)"
    }
