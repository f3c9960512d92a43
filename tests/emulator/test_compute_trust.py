"""A model file is data: a compute reference in an emulator loadable (``module:function``)
is imported only when the user says so (``trust_compute=True``, ``--trust-compute``, or
a ``compute=`` of their own); otherwise opening refuses with a ModelError naming it, and
nothing is imported."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from aiodla import EmulatedRuntime, Engine, ModelError, _cli
from aiodla.emulator import make_loadable

from support import X, Y

REFUSAL = "names the compute function 'planted_module:run'"


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module on the import path that leaves a mark when it is imported, as a
    module planted beside a model would; returns the mark's path."""
    mark = tmp_path / "imported"
    (tmp_path / "planted_module.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(mark)!r}).write_text('ran')\n"
        "def run(inputs):\n"
        "    return {'y': inputs['x'].astype('float32') * 2}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "planted_module", raising=False)
    return mark


def ran(mark: Path) -> bool:
    """Whether the planted module was imported (its code ran)."""
    return mark.exists()


def planted_model(path: Path | None = None) -> bytes:
    data = make_loadable([X], [Y], latency=0.001, compute="planted_module:run")
    if path is not None:
        path.write_bytes(data)
    return data


def sample() -> np.ndarray[Any, Any]:
    return np.full(X.shape, 0.5, np.float32)


@pytest.mark.asyncio
class TestEngine:
    @pytest.mark.parametrize("runtime", ["auto", "emulated"])
    async def test_refused_without_trust_and_nothing_imported(
        self, planted: Path, runtime: str
    ) -> None:
        engine = Engine(planted_model(), runtime=runtime)
        with pytest.raises(ModelError, match=REFUSAL) as caught:
            await engine.open()
        assert "trust_compute=True" in str(caught.value)
        assert not ran(planted)
        assert "planted_module" not in sys.modules

    async def test_an_emulated_runtime_refuses_too(self, planted: Path) -> None:
        with pytest.raises(ModelError, match=REFUSAL):
            await Engine(planted_model(), runtime=EmulatedRuntime()).open()
        assert not ran(planted)

    async def test_trust_compute_runs_it(self, planted: Path) -> None:
        async with Engine(planted_model(), runtime="emulated", trust_compute=True) as engine:
            y = await engine.infer(sample())
        np.testing.assert_array_equal(y, np.full(Y.shape, 1.0, np.float32))
        assert ran(planted)

    async def test_a_trusting_runtime_runs_it(self, planted: Path) -> None:
        runtime = EmulatedRuntime(trust_compute=True)
        async with Engine(planted_model(), runtime=runtime) as engine:
            await engine.infer(sample())
        assert ran(planted)

    async def test_a_compute_of_ones_own_is_used_and_the_files_is_not_imported(
        self, planted: Path
    ) -> None:
        def tripled(inputs: Any) -> dict[str, Any]:
            return {"y": inputs["x"].astype(np.float32) * 3}

        async with Engine(planted_model(), runtime=EmulatedRuntime(compute=tripled)) as engine:
            y = await engine.infer(sample())
        np.testing.assert_array_equal(y, np.full(Y.shape, 1.5, np.float32))
        assert not ran(planted)

    async def test_trust_compute_with_a_runtime_instance_is_refused(self) -> None:
        with pytest.raises(ValueError, match="EmulatedRuntime\\(trust_compute=True\\)"):
            await Engine(planted_model(), runtime=EmulatedRuntime(), trust_compute=True).open()

    async def test_the_worker_process_refuses_too(self, planted: Path) -> None:
        engine = Engine(planted_model(), runtime="emulated", isolation="process")
        with pytest.raises(ModelError, match=REFUSAL):
            await engine.open()
        assert not ran(planted)

    async def test_the_worker_process_runs_it_when_trusted(
        self, planted: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The worker imports it in its own interpreter, from the import path it inherits.
        path = os.pathsep.join([str(planted.parent), os.environ.get("PYTHONPATH", "")])
        monkeypatch.setenv("PYTHONPATH", path)
        async with Engine(
            planted_model(), runtime="emulated", isolation="process", trust_compute=True
        ) as engine:
            y = await engine.infer(sample())
        np.testing.assert_array_equal(y, np.full(Y.shape, 1.0, np.float32))

    async def test_the_testing_plugin_imports_no_reference(
        self, planted: Path, aiodla_engine: Any
    ) -> None:
        # The plugin serves a described model's I/O; its compute is the one passed.
        engine = await aiodla_engine(planted_model())
        await engine.infer(sample())
        assert not ran(planted)


class TestCommandLine:
    def test_inspect_shows_the_reference(self, planted: Path, tmp_path: Path) -> None:
        path = tmp_path / "m.bin"
        planted_model(path)
        shown = CliRunner().invoke(_cli.cli, ["inspect", str(path)])
        assert shown.exit_code == 0, shown.output
        assert "computed by planted_module:run" in " ".join(shown.output.split())
        spec = CliRunner().invoke(_cli.cli, ["inspect", str(path), "--json"])
        assert json.loads(spec.output)["emulator"]["compute"] == "planted_module:run"
        assert not ran(planted)

    def test_bench_refuses_without_trust(self, planted: Path, tmp_path: Path) -> None:
        path = tmp_path / "m.bin"
        planted_model(path)
        result = CliRunner().invoke(_cli.cli, ["bench", str(path), "--requests", "4"])
        assert result.exit_code == 1
        assert REFUSAL in result.output
        assert "--trust-compute" in result.output
        assert not ran(planted)

    def test_bench_runs_it_with_trust_compute(self, planted: Path, tmp_path: Path) -> None:
        path = tmp_path / "m.bin"
        planted_model(path)
        result = CliRunner().invoke(
            _cli.cli, ["bench", str(path), "--requests", "4", "--trust-compute", "--json"]
        )
        assert result.exit_code == 0, result.output
        assert ran(planted)

    @staticmethod
    def record(tmp_path: Path, *options: str) -> Any:
        path, samples = tmp_path / "m.bin", tmp_path / "samples"
        planted_model(path)
        samples.mkdir()
        np.save(samples / "0.npy", sample())
        arguments = ["record", str(path), "--inputs", str(samples), "-o", str(tmp_path / "r.npz")]
        return CliRunner().invoke(_cli.cli, [*arguments, "--runtime", "emulated", *options])

    def test_record_refuses_without_trust(self, planted: Path, tmp_path: Path) -> None:
        result = self.record(tmp_path)
        assert result.exit_code == 1
        assert REFUSAL in " ".join(result.output.split())
        assert "--trust-compute" in result.output
        assert not ran(planted)
        assert not (tmp_path / "r.npz").exists()

    def test_record_runs_it_with_trust_compute(self, planted: Path, tmp_path: Path) -> None:
        result = self.record(tmp_path, "--trust-compute")
        assert result.exit_code == 0, result.output
        assert ran(planted)
        with np.load(tmp_path / "r.npz") as recording:  # the planted function's outputs
            np.testing.assert_array_equal(
                recording["output/y"][0], sample().astype(np.float16).astype(np.float32) * 2
            )

    def test_serve_takes_trust_compute(self) -> None:
        result = CliRunner().invoke(_cli.cli, ["serve", "--help"])
        assert "--trust-compute" in result.output
