"""Hostile values in a JSON request: nesting deeper than a tensor's rank is refused
before the parser goes deeper, and float values the input's datatype cannot hold
(beyond its range, or JSON's non-standard NaN and Infinity) are refused naming the
input, by the rule ``Engine.infer`` applies, instead of reaching the model as infinity.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import numpy as np
import pytest

from aiodla import InputValueError
from aiodla.serve import Server

INFER = "/v2/models/{}/infer"


async def post(server: Server, model: str, body: bytes) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{server.http_port}{INFER.format(model)}"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body) as response,
    ):
        assert response.content_type == "application/json", await response.text()
        return response.status, await response.json()


def request(data: str, *, name: str = "x", datatype: str = "FP16", binary_out: bool) -> bytes:
    """An affine-model request whose input's ``data`` is the JSON text given."""
    head = json.dumps({"name": name, "datatype": datatype, "shape": [1, 3, 8, 8]})
    parameters = json.dumps({"binary_data_output": binary_out})
    return f'{{"inputs": [{head[:-1]}, "data": {data}}}], "parameters": {parameters}}}'.encode()


@pytest.mark.asyncio
@pytest.mark.parametrize("depth", [8, 400, 100_000])
async def test_nesting_deeper_than_the_rank_is_refused(server: Server, depth: int) -> None:
    """400, not a RecursionError's 500, at any depth; the server still serves."""
    status, body = await post(
        server, "affine", request("[" * depth + "]" * depth, binary_out=False)
    )
    assert status == 400, body
    assert "nests deeper than 7 levels" in body["error"], body
    assert server.statistics().failed == {"INVALID_ARGUMENT": 1}
    # Brackets inside strings are not nesting; the rank's own depth is taken.
    x = np.arange(192, dtype=np.float16).reshape(1, 3, 8, 8)
    status, body = await post(server, "affine", request(json.dumps(x.tolist()), binary_out=False))
    assert status == 200, body
    odd = request(json.dumps(x.tolist()), binary_out=False).replace(
        b'"parameters"', b'"id": "' + b"[" * 50 + b'", "parameters"', 1
    )
    status, body = await post(server, "affine", odd)
    assert status == 200 and body["id"] == "[" * 50, body


@pytest.mark.asyncio
@pytest.mark.parametrize("binary_out", [True, False])
@pytest.mark.parametrize("value", ["70000", "-1e5", "1e400", "NaN", "Infinity", "-Infinity"])
async def test_fp16_values_it_cannot_hold_are_refused(
    server: Server, value: str, binary_out: bool
) -> None:
    data = "[" + ", ".join(["1.5"] * 100 + [value] + ["0"] * 91) + "]"
    status, body = await post(server, "affine", request(data, binary_out=binary_out))
    assert status == 400, body
    assert "'x'" in body["error"], body
    assert server.statistics().failed == {"INVALID_ARGUMENT": 1}
    assert server.statistics().succeeded == 0


@pytest.mark.asyncio
async def test_the_range_rule_is_the_engines(server: Server) -> None:
    """The server's message is the one ``Engine.infer`` gives for the same values."""
    x = np.full((1, 3, 8, 8), 1.5)
    x[0, 1, 2, 3] = 70000.0
    with pytest.raises(InputValueError) as engine_error:
        await server.models["affine"].engine.infer(x)
    status, body = await post(
        server, "affine", request(json.dumps(x.ravel().tolist()), binary_out=True)
    )
    assert status == 400
    assert body["error"] == str(engine_error.value)
    assert "'x'" in body["error"] and "(0, 1, 2, 3)" in body["error"]


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        (b"1", 0),
        (b"[[1], {}]", 2),
        (b'{"a": "[[[[{{", "b": [[]]}', 3),
        (b'{"a": "x\\\\"}', 1),  # an escaped backslash: the quote ends the string
        (b'{"a": "\\"[[", "b": [[[]]]}', 4),  # an escaped quote does not
        (b'["\\\\\\"[", [[]]]', 3),
    ],
)
def test_nesting_is_measured_outside_strings(text: bytes, depth: int) -> None:
    from aiodla.serve import _json

    assert json.loads(text) is not None  # each is valid JSON
    assert _json.nesting(text) == depth
    assert _json.loads(text, depth) == json.loads(text)
    if depth:
        with pytest.raises(_json.NestingError):
            _json.loads(text, depth - 1)


def test_an_unclosed_string_counts_what_follows() -> None:
    from aiodla.serve import _json

    assert _json.nesting(b'["unclosed [[[[') == 5
