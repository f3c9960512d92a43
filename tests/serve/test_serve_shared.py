"""``aiodla serve`` with several models: one shared aiodla.Cores, --priority and
--weight per model name, metrics labelled by model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from click.testing import CliRunner

from aiodla import ConfigurationError, TensorSpec, _cli
from aiodla.emulator import make_loadable
from aiodla.serve import Server, serve
from aiodla.testing import DLAControls

from support import affine_model

# The served engines share the controls' runtime instance through one aiodla.Cores.
pytestmark = pytest.mark.in_process


@pytest.fixture
def models(tmp_path: Path) -> list[str]:
    det, cls = tmp_path / "det.bin", tmp_path / "cls.bin"
    det.write_bytes(affine_model(0.003))
    x = TensorSpec("x", (1, 3, 8, 8), "float16", "chw16")
    y = TensorSpec("y", (1, 3, 1, 1), "float32", "nchw")
    cls.write_bytes(make_loadable([x], [y], "mean_hw", 0.001, scale=1.0, bias=0.0))
    return [str(det), f"cls={cls}"]


@contextlib.asynccontextmanager
async def serving(
    models: list[str], controls: DLAControls, **options: Any
) -> AsyncIterator[Server]:
    started: asyncio.Future[Server] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(
            models,
            http="127.0.0.1:0",
            grpc=None,
            runtime=controls.runtime,
            started=started.set_result,
            **options,
        )
    )
    try:
        yield await asyncio.wait_for(asyncio.shield(started), 30)
    finally:
        if started.done():
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.asyncio
async def test_several_models_share_one_cores_with_their_priorities(
    models: list[str], aiodla_controls: DLAControls
) -> None:
    async with serving(
        models, aiodla_controls, priorities={"det": 1}, weights={"cls": 2.5}
    ) as server:
        det, cls = server.model("det").engine, server.model("cls").engine
        assert (det.options.priority, det.options.weight) == (1, 1.0)
        assert (cls.options.priority, cls.options.weight) == (0, 2.5)
        assert det.runtime is cls.runtime is aiodla_controls.runtime
        assert det.shared_cores is not None and det.shared_cores is cls.shared_cores
        url = f"http://127.0.0.1:{server.http_port}"
        frame = np.full((1, 3, 8, 8), 2, np.float16)
        body = {"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP16",
                            "data": frame.ravel().tolist()}]}  # fmt: skip
        async with aiohttp.ClientSession() as session:
            for name in ("det", "cls"):
                async with session.post(f"{url}/v2/models/{name}/infer", json=body) as answer:
                    assert answer.status == 200, await answer.text()
                    out = (await answer.json())["outputs"][0]["data"]
            np.testing.assert_allclose(out, [2.0] * 3)
            async with session.get(f"{url}/metrics") as answer:
                metrics = await answer.text()
        assert 'aiodla_request_success_total{engine="det"} 1.0' in metrics
        assert 'aiodla_request_success_total{engine="cls"} 1.0' in metrics
        assert 'nv_inference_request_success{model="cls",version="1"} 1.0' in metrics
    assert all(n == 0 for n in aiodla_controls.runtime.live_handles().values())


@pytest.mark.asyncio
async def test_a_share_for_an_unknown_model_fails_before_anything_opens(
    models: list[str], aiodla_controls: DLAControls
) -> None:
    with pytest.raises(ConfigurationError, match=r"--priority names \['seg'\]"):
        await serve(models, runtime=aiodla_controls.runtime, priorities={"seg": 2})
    assert all(n == 0 for n in aiodla_controls.runtime.live_handles().values())


@pytest.mark.parametrize(
    "option", [["--priority", "det"], ["--priority", "det=high"], ["--weight", "cls=x"]]
)
def test_the_command_refuses_a_malformed_share(option: list[str]) -> None:
    result = CliRunner().invoke(_cli.cli, ["serve", "det.bin", *option])
    assert result.exit_code == 2
    assert "expected NAME=" in result.output


def test_the_command_passes_each_models_share_to_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodla.serve import _app

    given: dict[str, Any] = {}

    async def recording(models: list[str], **options: Any) -> None:
        given.update(options, models=models)

    monkeypatch.setattr(_app, "serve", recording)
    result = CliRunner().invoke(
        _cli.cli,
        ["serve", "det=det.bin", "cls=cls.bin", "--priority", "det=1", "--priority",
         "cls=-2", "--weight", "cls=2.5"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert list(given["models"]) == ["det=det.bin", "cls=cls.bin"]
    assert given["priorities"] == {"det": 1, "cls": -2}
    assert given["weights"] == {"cls": 2.5}


@pytest.mark.asyncio
async def test_a_weight_out_of_its_range_is_refused(
    models: list[str], aiodla_controls: DLAControls
) -> None:
    # (--weight cls=1e-16 once made every other model's weight stop counting)
    with pytest.raises(ConfigurationError, match=r"weight=1e-16 must be a number > 0, from"):
        await serve(models, runtime=aiodla_controls.runtime, weights={"cls": 1e-16})
    assert all(n == 0 for n in aiodla_controls.runtime.live_handles().values())
