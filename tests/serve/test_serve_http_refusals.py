"""Each request the HTTP front refuses, read off the wire: its status code and the whole
``{"error": ...}`` a client's author reads to fix it (the header's length, the JSON
envelope, each input and output field, the binary data's sizes, the ``timeout``
parameter). A refused request never reaches the engine, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import numpy as np
import pytest
from clients import until

from aiodla import Engine, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.serve import Server
from aiodla.testing import EngineFactory

from support import X, expected_affine

pytestmark = pytest.mark.asyncio

HEADER_LENGTH = "Inference-Header-Content-Length"
XS = (np.arange(np.prod(X.shape)).reshape(X.shape) / 8).astype(np.float16)
TENSOR = {"name": "x", "datatype": "FP16", "shape": list(X.shape)}
DATA = {**TENSOR, "data": XS.ravel().tolist()}
HEAD = b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"


async def post(
    server: Server, body: bytes, headers: dict[str, str] | None = None, model: str = "affine"
) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=headers) as response,
    ):
        return response.status, json.loads(await response.read())


def request(**fields: Any) -> bytes:
    return json.dumps({"inputs": [DATA], **fields}).encode()


def binary(header: dict[str, Any], data: bytes) -> tuple[bytes, dict[str, str]]:
    """A request with binary data: the JSON header, then ``data``."""
    text = json.dumps(header).encode()
    return text + data, {HEADER_LENGTH: str(len(text))}


def sized(size: object) -> dict[str, Any]:
    return {"inputs": [{**TENSOR, "parameters": {"binary_data_size": size}}]}


async def served_after(server: Server, engines: dict[str, Engine]) -> None:
    """The refusal reached no engine, and the next request is served."""
    assert engines["affine"].statistics().submitted == 0
    status, answer = await post(server, request())
    assert status == 200, answer
    (output,) = answer["outputs"]
    y = np.asarray(output["data"], np.float32).reshape(output["shape"])
    np.testing.assert_array_equal(y, expected_affine(XS))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[1, 2]", "the request JSON must be an object"),
        (b'"inputs"', "the request JSON must be an object"),
        (b"{}", "the request must have a list of 'inputs'"),
        (b'{"inputs": {"name": "x"}}', "the request must have a list of 'inputs'"),
        (b'{"inputs": [5]}', "'inputs[]' must be a JSON object"),
        (request(parameters=[1]), "'parameters' must be a JSON object"),
        (
            json.dumps({"inputs": [{**DATA, "parameters": "binary"}]}).encode(),
            "'parameters' must be a JSON object",
        ),
        (
            json.dumps({"inputs": [DATA, DATA]}).encode(),
            "input 'x' given twice",
        ),
        (
            json.dumps({"inputs": [TENSOR]}).encode(),
            "input 'x' has neither 'data' nor 'binary_data_size'",
        ),
        (
            request(outputs=[{"name": "y", "parameters": {"classification": 2}}]),
            "the classification extension is not supported",
        ),
        (
            request(outputs=[{"name": "y", "parameters": {"binary_data": 1}}]),
            "output parameter 'binary_data' must be true or false",
        ),
        (
            request(parameters={"binary_data_output": 1}),
            "parameter 'binary_data_output' must be true or false",
        ),
        (request(outputs="y"), "'outputs' must be a list"),
        (
            request(parameters={"timeout": -1}),
            "parameter 'timeout' must be whole microseconds >= 0, got -1",
        ),
        (
            request(parameters={"timeout": 2.5}),
            "parameter 'timeout' must be whole microseconds >= 0, got 2.5",
        ),
        (
            request(parameters={"timeout": True}),
            "parameter 'timeout' must be whole microseconds >= 0, got True",
        ),
        (
            request(parameters={"timeout": "100"}),
            "parameter 'timeout' must be whole microseconds >= 0, got '100'",
        ),
    ],
)
async def test_a_malformed_request_is_400_with_its_message(
    server: Server, engines: dict[str, Engine], body: bytes, message: str
) -> None:
    status, answer = await post(server, body)
    assert (status, answer) == (400, {"error": message})
    await served_after(server, engines)


async def test_json_that_does_not_parse_is_400_with_the_parsers_words(
    server: Server, engines: dict[str, Engine]
) -> None:
    status, answer = await post(server, b'{"inputs": [')
    assert (status, answer) == (
        400,
        {"error": "failed to parse the request JSON: Expecting value: line 1 column 13 (char 12)"},
    )
    status, answer = await post(server, b'{"inputs": "\xff"}')
    assert status == 400
    assert answer["error"].startswith("failed to parse the request JSON: 'utf-8' codec can't")
    await served_after(server, engines)


async def test_json_nested_deeper_than_the_inputs_rank_is_400_saying_how_deep(
    server: Server, engines: dict[str, Engine]
) -> None:
    # x has rank 4: the request object, "inputs", the tensor's object, then 4 levels.
    data = json.dumps(XS.reshape(1, 3, 8, 8, 1).tolist())
    body = b'{"inputs": [{"name": "x", "datatype": "FP16", "shape": [1, 3, 8, 8], "data": '
    status, answer = await post(server, body + data.encode() + b"}]}")
    assert (status, answer) == (
        400,
        {
            "error": "the request JSON nests deeper than 7 levels: an input's data nests once "
            "per dimension, at most 4 for model 'affine', inside the request's object, its "
            "'inputs' list and the input's object"
        },
    )
    await served_after(server, engines)


@pytest.mark.parametrize("length", ["abc", "-1", "100000", "1.5"])
async def test_a_header_length_not_within_the_body_is_400(
    server: Server, engines: dict[str, Engine], length: str
) -> None:
    status, answer = await post(server, request(), {HEADER_LENGTH: length})
    assert (status, answer) == (
        400,
        {"error": f"{HEADER_LENGTH}: {length!r} is not a length within the body"},
    )
    await served_after(server, engines)


@pytest.mark.parametrize(
    ("size", "shown"), [(-1, "-1"), (385, "385"), (True, "True"), ("384", "'384'"), (1.5, "1.5")]
)
async def test_a_binary_data_size_past_the_data_is_400(
    server: Server, engines: dict[str, Engine], size: object, shown: str
) -> None:
    body, headers = binary(sized(size), XS.tobytes())
    status, answer = await post(server, body, headers)
    assert (status, answer) == (
        400,
        {"error": f"input 'x': binary_data_size {shown} runs past the 384 bytes of binary data"},
    )
    await served_after(server, engines)


async def test_binary_data_the_inputs_do_not_take_is_400(
    server: Server, engines: dict[str, Engine]
) -> None:
    body, headers = binary({"inputs": [DATA]}, b"\0" * 3)
    status, answer = await post(server, body, headers)
    assert (status, answer) == (
        400,
        {"error": "the request has 3 bytes of binary data but its inputs take 0"},
    )
    await served_after(server, engines)


async def test_binary_data_of_the_exact_size_is_served(server: Server) -> None:
    """The bounds above are exact: a binary_data_size equal to the data is taken, and a
    JSON header whose length is the whole body has no binary part."""
    body, headers = binary(sized(XS.nbytes), XS.tobytes())
    status, answer = await post(server, body, headers)
    assert status == 200, answer
    text = request()
    status, answer = await post(server, text, {HEADER_LENGTH: str(len(text))})
    assert status == 200, answer
    (output,) = answer["outputs"]
    y = np.asarray(output["data"], np.float32).reshape(output["shape"])
    np.testing.assert_array_equal(y, expected_affine(XS))


async def test_a_timeout_of_zero_means_none(server: Server) -> None:
    status, answer = await post(server, request(parameters={"timeout": 0}))
    assert status == 200, answer


async def test_an_upload_still_arriving_when_the_drain_ends_is_503_saying_so(
    engines: dict[str, Engine],
) -> None:
    server = Server(engines, http="127.0.0.1:0", grpc=None, drain_timeout=0.05)
    await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        writer.write(HEAD % 1000 + b'{"inputs": [')
        await writer.drain()
        await until(lambda: server.statistics().in_flight == 1)
        closing = asyncio.ensure_future(server.stop())
        head, answer = await answer_of(reader)
        await closing
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 503 "), head
    assert answer == {
        "error": "the server shut down before the request body arrived (drain timeout)"
    }
    assert server.statistics().failed == {"UNAVAILABLE": 1}
    # The front keeps no handler it stopped (or read for): nothing held past its answer.
    assert not server._http._reading and not server._http._stopped  # type: ignore[union-attr]


async def test_a_body_that_stalls_is_408_saying_how_long_it_had(
    engines: dict[str, Engine],
) -> None:
    async with Server(engines, http="127.0.0.1:0", grpc=None, body_timeout=0.05) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        try:
            writer.write(HEAD % 1000 + b'{"inputs": [')
            await writer.drain()
            head, answer = await answer_of(reader)
        finally:
            writer.close()
    assert head.startswith(b"HTTP/1.1 408 "), head
    # Under a MiB, a body has a MiB's time: 0.05 s.
    assert answer == {
        "error": "the request body of 1000 bytes did not arrive within 0.05 s (12 bytes "
        "came; body_timeout is 0.05 s a MiB)"
    }


@pytest.mark.parametrize("route", ["", "/ready", "/config", "/versions/2/ready"])
async def test_an_unknown_model_or_version_is_json_404_naming_it(
    server: Server, route: str
) -> None:
    name = "nope" if "versions" not in route else "affine"
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{name}{route}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        status, answer = response.status, json.loads(await response.read())
    which = "'nope'" if name == "nope" else "'affine' version 2"
    assert (status, answer) == (404, {"error": f"Request for unknown model: {which} is not found"})


async def test_a_binary_data_size_of_zero_is_400_saying_what_the_input_needs(
    server: Server, engines: dict[str, Engine]
) -> None:
    """Zero bytes lie within any binary part: the input's own size is what is wrong."""
    body, headers = binary(sized(0), b"")
    status, answer = await post(server, body, headers)
    assert (status, answer) == (
        400,
        {"error": "input 'x': 0 bytes of FP16, shape [1, 3, 8, 8] needs 384"},
    )
    await served_after(server, engines)


async def test_a_header_length_of_zero_leaves_no_json_to_parse(
    server: Server, engines: dict[str, Engine]
) -> None:
    status, answer = await post(server, request(), {HEADER_LENGTH: "0"})
    assert (status, answer) == (
        400,
        {"error": "failed to parse the request JSON: Expecting value: line 1 column 1 (char 0)"},
    )
    await served_after(server, engines)


async def test_a_large_json_header_before_binary_data_is_served(server: Server) -> None:
    """A header over the size parsed off the loop (an 80 kB id) is cut at its length
    there too, and binary outputs come back as octet-stream."""
    header = {**sized(XS.nbytes), "id": "i" * 80_000, "parameters": {"binary_data_output": True}}
    body, headers = binary(header, XS.tobytes())
    url = f"http://127.0.0.1:{server.http_port}/v2/models/affine/infer"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=headers) as response,
    ):
        status, answer, kind = response.status, await response.read(), response.content_type
    assert status == 200, answer[:200]
    assert kind == "application/octet-stream"
    length = int(response.headers[HEADER_LENGTH])
    text = json.loads(answer[:length])
    assert text["id"] == header["id"]
    (output,) = text["outputs"]
    y = np.frombuffer(answer[length:], np.float32).reshape(output["shape"])
    np.testing.assert_array_equal(y, expected_affine(XS))


async def answer_of(reader: asyncio.StreamReader) -> tuple[bytes, Any]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, json.loads(await reader.readexactly(length))


async def test_a_body_that_trickles_in_is_408_once_its_waits_add_up_to_its_time(
    engines: dict[str, Engine],
) -> None:
    # Ten pieces, each 0.1 s or more after the one before: no single wait reaches the
    # body's 0.5 s, their sum (0.9 s at least) does.
    body = request()
    pieces = [body[i * len(body) // 10 : (i + 1) * len(body) // 10] for i in range(10)]
    async with Server(engines, http="127.0.0.1:0", grpc=None, body_timeout=0.5) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)

        async def trickle() -> None:
            writer.write(HEAD % len(body) + pieces[0])
            for piece in pieces[1:]:
                await asyncio.sleep(0.1)
                writer.write(piece)

        sending = asyncio.ensure_future(trickle())
        try:
            head, answer = await answer_of(reader)
        finally:
            sending.cancel()
            writer.close()
    assert head.startswith(b"HTTP/1.1 408 "), (head, answer)
    assert answer["error"].startswith(
        f"the request body of {len(body)} bytes did not arrive within 0.5 s ("
    )


async def test_a_body_over_a_mib_has_as_many_mibs_of_time(
    aiodla_engine: EngineFactory,
) -> None:
    spec = TensorSpec("x", (1, 16, 256, 256), "float16", "nchw")  # a limit over 3 MiB
    out = TensorSpec("y", spec.shape, "float16", "nchw")
    engine = await aiodla_engine(make_loadable([spec], [out], "affine", 0.001))
    size = 3 * 1024 * 1024
    async with Server({"big": engine}, http="127.0.0.1:0", grpc=None, body_timeout=0.05) as server:
        assert server.max_request_bytes > size
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        try:
            writer.write(HEAD.replace(b"affine", b"big") % size + b'{"inputs": [')
            head, answer = await answer_of(reader)
        finally:
            writer.close()
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert answer == {
        "error": f"the request body of {size} bytes did not arrive within 0.15 s (12 bytes "
        "came; body_timeout is 0.05 s a MiB)"
    }


async def test_a_chunked_body_that_stalls_is_408_without_a_size(
    engines: dict[str, Engine],
) -> None:
    async with Server(engines, http="127.0.0.1:0", grpc=None, body_timeout=0.05) as server:
        # A body of unknown length has the time of the largest the models take.
        allowed = 0.05 * max(1.0, server.max_request_bytes / (1024 * 1024))
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        try:
            writer.write(
                b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\n"
                b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"inp\r\n'
            )
            await writer.drain()
            head, answer = await answer_of(reader)
        finally:
            writer.close()
        # A served request's handler is not kept either.
        assert not server._http._reading  # type: ignore[union-attr]
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert answer == {
        "error": f"the request body did not arrive within {allowed:g} s (5 bytes came; "
        "body_timeout is 0.05 s a MiB)"
    }


async def test_a_body_that_does_not_decode_is_400_in_one_line(
    server: Server, engines: dict[str, Engine]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        writer.write(
            b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Encoding: gzip\r\nContent-Length: 10\r\n\r\nnot gzip!!"
        )
        await writer.drain()
        head, answer = await answer_of(reader)
        error = answer["error"]
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 400 "), head
    # aiohttp's own words, on one line.
    assert error.startswith("the request body cannot be read: "), error
    assert "content-encoding: gzip" in error.lower() and "\n" not in error, error
    await served_after(server, engines)


async def test_a_client_gone_before_its_body_is_counted_cancelled(server: Server) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    writer.write(HEAD % 1000 + b'{"inputs": [')
    await writer.drain()
    await until(lambda: server.statistics().in_flight == 1)
    writer.close()
    await until(lambda: server.statistics().in_flight == 0)
    assert server.statistics().failed == {"CANCELLED": 1}
