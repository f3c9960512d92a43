"""aiodla.testing: the model descriptions, the controls, and the pytest plugin as a
user's suite sees it (an inner pytest session in a subprocess, through the entry
point, with a leaky test that the teardown check must fail)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from aiodla import Engine, EngineDeadError, ModelError, TaskError, TensorSpec, _cli
from aiodla.emulator import make_loadable, parse_loadable
from aiodla.testing import (
    DLA_TASK_FAILURE,
    DLAControls,
    EngineFactory,
    HandleLeakError,
    emulated_model,
)
from aiodla.testing import plugin as aiodla_plugin

from support import X, Y, expected_affine, two_pair_model

ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = ["pytester"]

ONES = np.ones(X.shape, np.float32)
ENGINE_TIMEOUT = 0x40000006


def inspect_json(tmp_path: Path, loadable: bytes) -> dict[str, Any]:
    """What 'aiodla inspect MODEL --json' prints for ``loadable``."""
    path = tmp_path / "model.bin"
    path.write_bytes(loadable)
    result = CliRunner().invoke(_cli.cli, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def as_if_from_a_jetson(document: dict[str, Any]) -> dict[str, Any]:
    """The spec of a real DLA loadable: the same tensors, no emulator settings."""
    return {**document, "model": "detector.bin", "loadable": "dla", "emulator": None}


class TestModelDescriptions:
    @pytest.mark.asyncio
    async def test_spec_file_written_by_inspect(
        self, aiodla_engine: EngineFactory, tmp_path: Path
    ) -> None:
        loadable = two_pair_model(latency=0.002)
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps(inspect_json(tmp_path, loadable)))
        engine = await aiodla_engine(spec)
        original = parse_loadable(loadable)
        assert engine.inputs == original.inputs
        assert engine.outputs == original.outputs
        a = np.ones((1, 4, 6, 6), np.float32)
        b = np.full((2, 3, 5, 7), 2.0, np.float32)
        result = await engine.infer({"a": a, "b": b})
        # The spec's own emulator settings: mean over H and W, then 3 * m - 1.
        np.testing.assert_array_equal(result["mean_a"], np.full((1, 4, 1, 1), 2.0))
        np.testing.assert_array_equal(result["mean_b"], np.full((2, 3, 1, 1), 5.0))

    @pytest.mark.asyncio
    async def test_spec_dict_of_a_dla_loadable(
        self, aiodla_engine: EngineFactory, tmp_path: Path
    ) -> None:
        document = as_if_from_a_jetson(inspect_json(tmp_path, make_loadable([X], [Y])))
        engine = await aiodla_engine(document, scale=2.0, bias=0.5)
        assert [s.name for s in engine.inputs] == ["x"]
        np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))

    def test_defaults_and_overrides(self, tmp_path: Path) -> None:
        model = parse_loadable(emulated_model(inputs=[X], outputs=[Y]))
        assert (model.op, model.latency, model.scale, model.bias) == ("affine", 0.001, 1.0, 0.0)
        document = inspect_json(tmp_path, two_pair_model(latency=0.004))
        model = parse_loadable(emulated_model(document))
        assert (model.op, model.latency, model.scale, model.bias) == ("mean_hw", 0.004, 3.0, -1.0)
        model = parse_loadable(emulated_model(document, latency=0.01, scale=1.0))
        assert (model.latency, model.scale, model.bias) == (0.01, 1.0, -1.0)
        loadable = make_loadable([X], [Y], latency=0.003)
        assert emulated_model(loadable) == loadable
        assert parse_loadable(emulated_model(loadable, latency=0.0)).latency == 0.0

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"format": "something-else"}, "not an aiodla model spec"),
            ({"version": 2}, "version 2; this aiodla reads version 1"),
            ({"inputs": []}, "'inputs' must be a non-empty list"),
            ({"outputs": [{"name": "y"}]}, 'outputs[0] has no "descriptor" object'),
        ],
    )
    def test_unreadable_specs(self, tmp_path: Path, change: dict[str, Any], message: str) -> None:
        document = {**inspect_json(tmp_path, make_loadable([X], [Y])), **change}
        with pytest.raises(ModelError) as caught:
            emulated_model(document)
        assert message in str(caught.value)
        path = tmp_path / "spec.json"
        path.write_text(json.dumps(document))
        with pytest.raises(ModelError) as caught:
            emulated_model(path)
        assert message in str(caught.value) or "version 2" in str(caught.value)

    def test_models_the_emulator_cannot_stand_in_for(self, tmp_path: Path) -> None:
        with pytest.raises(ModelError, match="DLA loadable, which only a DLA runs"):
            emulated_model(b"NVDA" + bytes(60))
        logits = TensorSpec("logits", (1, 1000, 1, 1), "float16", "nchw")
        assert parse_loadable(emulated_model(inputs=[X], outputs=[logits])).op == "mix"
        with pytest.raises(ModelError, match="cannot read"):
            emulated_model(tmp_path / "missing.json")
        with pytest.raises(ModelError, match="op='conv' is unknown"):
            emulated_model(inputs=[X], outputs=[Y], op="conv")

    def test_misuse(self) -> None:
        with pytest.raises(TypeError, match="not both"):
            emulated_model(make_loadable([X], [Y]), inputs=[X], outputs=[Y])
        with pytest.raises(TypeError, match="not both"):
            emulated_model()
        with pytest.raises(TypeError, match="both inputs= and outputs="):
            emulated_model(inputs=[X])
        with pytest.raises(TypeError, match="must be TensorSpecs"):
            emulated_model(inputs=[X], outputs=["y"])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="spec must be"):
            emulated_model(42)  # type: ignore[arg-type]

    @pytest.mark.asyncio
    async def test_the_factory_owns_the_runtime(self, aiodla_engine: EngineFactory) -> None:
        with pytest.raises(TypeError, match="no runtime="):
            await aiodla_engine(inputs=[X], outputs=[Y], runtime="emulated")


class TestControls:
    @pytest.mark.asyncio
    async def test_fail_next_on_one_core(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        engine = await aiodla_engine(inputs=[X], outputs=[Y], scale=2.0, bias=0.5)
        aiodla_controls.fail_next(core=1)
        # Four at once: the least-loaded policy sends two to each core.
        results = await asyncio.gather(
            *(engine.infer(ONES) for _ in range(4)), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, TaskError)]
        assert len(failed) == 1
        assert (failed[0].core, failed[0].status) == (1, DLA_TASK_FAILURE)
        assert sum(1 for r in results if isinstance(r, np.ndarray)) == 3
        assert engine.statistics().failures["task"] == 1

    @pytest.mark.asyncio
    async def test_fail_next_wherever_the_tasks_go(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        engine = await aiodla_engine(inputs=[X], outputs=[Y])
        aiodla_controls.fail_next(status=ENGINE_TIMEOUT, count=2)
        for _ in range(2):
            with pytest.raises(TaskError) as caught:
                await engine.infer(ONES)
            assert caught.value.status == ENGINE_TIMEOUT
        await engine.infer(ONES)

    @pytest.mark.asyncio
    async def test_delay_next(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        loop = asyncio.get_running_loop()

        async def timed(engine: Engine) -> float:
            started = loop.time()
            await engine.infer(ONES)
            return loop.time() - started

        # Orders and lower bounds only: a loaded machine makes every request slower.
        engine = await aiodla_engine(inputs=[X], outputs=[Y])
        aiodla_controls.delay_next(0.5)
        slow, fast = (asyncio.ensure_future(timed(engine)) for _ in range(2))
        done, _ = await asyncio.wait({slow, fast}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {fast}  # the delay is the next task's alone
        assert await slow >= 0.5
        # A delay for core 1 waits for a task there: requests on core 0 leave it armed.
        aiodla_controls.delay_next(0.5, core=1)
        core_0 = await aiodla_engine(inputs=[X], outputs=[Y], cores=[0])
        for _ in range(3):
            await timed(core_0)
        assert max(await asyncio.gather(timed(engine), timed(engine))) >= 0.5

    @pytest.mark.asyncio
    async def test_hold_reaches_states_without_sleeping(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        engine = await aiodla_engine(inputs=[X], outputs=[Y], scale=2.0, bias=0.5)
        with aiodla_controls.hold() as gate:
            assert gate.cores == (0, 1)
            requests = [asyncio.create_task(engine.infer(ONES * i)) for i in range(6)]
            await gate.reached(4)  # every slot busy, two requests queued
            stats = engine.statistics()
            assert (stats.in_flight, stats.queued, stats.completed) == (4, 2, 0)
            assert gate.count == 4
            assert not gate.released
            assert repr(gate) == "<Gate cores [0, 1] holding, 4 task(s) reached>"
            with pytest.raises(RuntimeError, match="core 0 is held already"):
                aiodla_controls.hold(0)
        assert gate.released
        for i, request in enumerate(requests):
            np.testing.assert_array_equal(await request, expected_affine(ONES * i))
        with aiodla_controls.hold(1) as again:  # a released core can be held again
            assert again.cores == (1,)

    @pytest.mark.asyncio
    async def test_reached_times_out_with_the_count(self, aiodla_controls: DLAControls) -> None:
        gate = aiodla_controls.hold(0)
        with pytest.raises(TimeoutError, match=r"0 of the 2 task\(s\) .* core\(s\) \[0\] within"):
            await gate.reached(2, timeout=0.01)
        await gate.reached(0)

    def test_bad_arguments(self, aiodla_controls: DLAControls) -> None:
        with pytest.raises(ValueError, match="core=2 is not one of the 2"):
            aiodla_controls.fail_next(core=2)
        with pytest.raises(ValueError, match="count=0"):
            aiodla_controls.fail_next(count=0)
        with pytest.raises(ValueError, match="seconds=-1"):
            aiodla_controls.delay_next(-1)
        with pytest.raises(ValueError, match="core=-1"):
            aiodla_controls.hold(-1)
        assert aiodla_controls.cores == 2

    # Process mode survives a lost context by replacing its worker (tests/test_isolation.py).
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_poison_kills_the_engine(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        engine = await aiodla_engine(inputs=[X], outputs=[Y])
        aiodla_controls.poison()
        with pytest.raises(EngineDeadError):
            await engine.infer(ONES)
        assert engine.health().status == "dead"

    @pytest.mark.asyncio
    async def test_teardown_releases_before_closing(self) -> None:
        controls = DLAControls()
        factory = EngineFactory(controls)
        engine = await factory(inputs=[X], outputs=[Y])
        gate = controls.hold()
        controls.delay_next(30.0)
        request = asyncio.create_task(engine.infer(ONES))
        await gate.reached(1)
        started = time.monotonic()
        await factory.aclose()  # not close_timeout (10 s): the gate goes first
        assert time.monotonic() - started < 9.0
        assert request.done()
        controls.check_released()

    @pytest.mark.asyncio
    async def test_leak_check(self) -> None:
        controls = DLAControls()
        engine = Engine(emulated_model(inputs=[X], outputs=[Y]), runtime=controls.runtime)
        await engine.open()
        with pytest.raises(HandleLeakError, match=r"alive at teardown \(devices 2, modules 2"):
            controls.check_released()
        await engine.aclose()
        controls.check_released()


USER_TESTS = """
import asyncio

import numpy as np
import pytest

from aiodla import Engine, TaskError
from aiodla.testing import emulated_model

SPEC = "detector-spec.json"
LEFT_OPEN = []


@pytest.mark.asyncio
async def test_engine_from_the_jetson_spec(aiodla_engine):
    engine = await aiodla_engine(SPEC, scale=2.0)
    y = await engine.infer(np.ones(engine.inputs[0].shape, np.float32))
    assert float(y.mean()) == 2.0


@pytest.mark.asyncio
async def test_controls(aiodla_engine, aiodla_controls):
    engine = await aiodla_engine(SPEC)
    aiodla_controls.fail_next()
    with pytest.raises(TaskError):
        await engine.infer(np.ones(engine.inputs[0].shape, np.float32))
    with aiodla_controls.hold() as gate:
        request = asyncio.ensure_future(engine.infer(np.ones(engine.inputs[0].shape)))
        await gate.reached(1)
        assert engine.statistics().in_flight == 1
    await request


@pytest.mark.asyncio
async def test_app_forgets_to_close_its_engine(aiodla_controls):
    engine = Engine(emulated_model(SPEC), runtime=aiodla_controls.runtime)
    await engine.open()
    LEFT_OPEN.append(engine)  # still referenced: the teardown check, not the GC, sees it
"""


class TestPluginFromOutside:
    def test_a_users_suite(self, pytester: pytest.Pytester, tmp_path: Path) -> None:
        spec = as_if_from_a_jetson(inspect_json(tmp_path, make_loadable([X], [Y])))
        pytester.makefile(".json", **{"detector-spec": json.dumps(spec)})
        pytester.makeini(
            "[pytest]\n"
            "asyncio_mode = strict\n"
            "asyncio_default_fixture_loop_scope = function\n"
            "filterwarnings = error\n"
            "timeout = 60\n"
        )
        pytester.makepyfile(test_app=USER_TESTS)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
        result.assert_outcomes(passed=3, errors=1)
        result.stdout.fnmatch_lines(
            [
                "plugins:*aiodla-*",
                "*ERROR at teardown of test_app_forgets_to_close_its_engine*",
                "*aiodla_controls: emulated DLA handles are still alive at teardown (devices 2, "
                "modules 2*an engine opened on this runtime was not closed*",
            ]
        )

    @pytest.mark.parametrize("configured", [True, False], ids=["as-the-guide-says", "unset"])
    def test_the_testing_guides_setting_quiets_the_loop_scope_warning(
        self, pytester: pytest.Pytester, tmp_path: Path, configured: bool
    ) -> None:
        """docs/guides/testing.md's pyproject.toml lines: pytest-asyncio's warning on
        every run goes (and without them it is there: the check can fail)."""
        guide = (ROOT / "docs" / "guides" / "testing.md").read_text(encoding="utf-8")
        (toml,) = re.findall(r"```toml\n(.*?)```", guide, re.S)
        assert toml.startswith("[tool.pytest.ini_options]\n")
        lines = toml if configured else "[tool.pytest.ini_options]\n"
        pytester.makefile(".toml", pyproject=lines + 'asyncio_mode = "strict"\n')
        spec = as_if_from_a_jetson(inspect_json(tmp_path, make_loadable([X], [Y])))
        pytester.makefile(".json", **{"detector-spec": json.dumps(spec)})
        pytester.makepyfile(
            test_app=USER_TESTS.split("\n\n@pytest.mark.asyncio\nasync def test_app")[0]
        )
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
        result.assert_outcomes(passed=2)
        output = result.stdout.str() + result.stderr.str()
        warned = '"asyncio_default_fixture_loop_scope" is unset' in output
        assert warned is not configured

    def test_the_plugin_only_defines_fixtures(self) -> None:
        # pytest loads it in every session where aiodla is installed: no hooks allowed.
        assert not [name for name in vars(aiodla_plugin) if name.startswith("pytest_")]
