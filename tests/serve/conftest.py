"""Fixtures for ``aiodla serve``: emulated models, a server on ephemeral loopback ports,
and Triton's own clients. Everything here skips when the ``serve`` extra or
tritonclient is not installed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

pytest.importorskip("aiohttp")
pytest.importorskip("grpc")
pytest.importorskip("tritonclient.http")
pytest.importorskip("tritonclient.grpc")

from aiodla import Engine, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.serve import Server
from aiodla.testing import EngineFactory

from support import affine_model, two_pair_model

# The int8 model's quantization steps (Engine(scales=...)): its output comes back FP32.
SCALES = {"q": 0.05, "r": 0.1}


def int8_model(latency: float = 0.001) -> bytes:
    """One INT8 input with a scale to one INT8 output with a scale: r = 1.5 q - 2."""
    q = TensorSpec("q", (1, 4, 4, 4), "int8", "nchw")
    r = TensorSpec("r", (1, 4, 4, 4), "int8", "nchw")
    return make_loadable([q], [r], "affine", latency, scale=1.5, bias=-2.0)


def uint8_model(latency: float = 0.001) -> bytes:
    """A uint8 image to uint8: out = 0.5 img + 3 (saturated)."""
    image = TensorSpec("image", (1, 3, 8, 8), "uint8", "nchw")
    out = TensorSpec("out", (1, 3, 8, 8), "uint8", "nchw")
    return make_loadable([image], [out], "affine", latency, scale=0.5, bias=3.0)


def sample(spec: TensorSpec, seed: int = 0) -> np.ndarray[Any, Any]:
    """Values of an input, in the datatype the server's metadata gives it."""
    rng = np.random.default_rng(seed)
    dtype = spec.numpy_dtype
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, spec.shape, endpoint=True).astype(dtype)
    return (rng.standard_normal(spec.shape) * 4).astype(dtype)


async def open_models(aiodla_engine: EngineFactory, **options: Any) -> dict[str, Engine]:
    return {
        "affine": await aiodla_engine(affine_model(), **options),
        "pair": await aiodla_engine(two_pair_model(), **options),
        "int8": await aiodla_engine(int8_model(), scales=SCALES, **options),
        "uint8": await aiodla_engine(uint8_model(), **options),
    }


@pytest_asyncio.fixture
async def engines(aiodla_engine: EngineFactory) -> dict[str, Engine]:
    return await open_models(aiodla_engine)


@pytest_asyncio.fixture
async def server(engines: dict[str, Engine]) -> AsyncIterator[Server]:
    async with Server(engines, http="127.0.0.1:0", grpc="127.0.0.1:0", drain_timeout=5) as s:
        yield s


def http_url(server: Server) -> str:
    return f"127.0.0.1:{server.http_port}"


def grpc_url(server: Server) -> str:
    return f"127.0.0.1:{server.grpc_port}"
