"""Recorded outputs: ``aiodla record`` (over the engine, so the emulated runtime
stands in for the Jetson here) and ``compute=replay(...)`` answering from it; and
``aiodla emulate --compute``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

from aiodla import ComputeError, EmulatedRuntime, Engine, ModelError, _cli
from aiodla.emulator import parse_loadable, replay

from support import X, affine_model, counts_add_up, two_pair_model


def run(*args: str) -> Result:
    return CliRunner().invoke(_cli.cli, list(args))


def samples(count: int, seed: int = 5) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(X.shape).astype(np.float32) for _ in range(count)]


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Path, Path, list[np.ndarray[Any, Any]]]:
    """An affine model, three .npy samples, and the recording of them."""
    model = tmp_path / "model.bin"
    model.write_bytes(affine_model())
    directory = tmp_path / "inputs"
    directory.mkdir()
    xs = samples(3)
    for index, x in enumerate(xs):
        np.save(directory / f"frame{index:03d}.npy", x)
    out = tmp_path / "recording.npz"
    result = run("record", str(model), "--inputs", str(directory), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "3 sample(s)" in result.output
    return model, out, xs


def affine(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return 2.0 * x.astype(np.float16).astype(np.float64) + 0.5


class TestRecord:
    def test_the_recording_holds_the_spec_inputs_and_outputs(self, recorded: Any) -> None:
        _, out, xs = recorded
        with np.load(out) as data:
            assert sorted(data.files) == ["input/x", "output/y", "spec"]
            inputs, outputs = data["input/x"], data["output/y"]
        assert inputs.dtype == np.float16  # as the DLA read them
        np.testing.assert_array_equal(inputs, np.stack([x.astype(np.float16) for x in xs]))
        np.testing.assert_allclose(outputs, np.stack([affine(x) for x in xs]), rtol=1e-6)
        spec = replay(out).spec
        assert [e["name"] for e in spec["inputs"]] == ["x"]
        assert spec["loadable"] == "emulator"

    def test_npz_samples_for_a_model_with_two_inputs(self, tmp_path: Path) -> None:
        model = tmp_path / "two.bin"
        model.write_bytes(two_pair_model())
        directory = tmp_path / "in"
        directory.mkdir()
        rng = np.random.default_rng(1)
        np.savez(
            directory / "s1.npz",
            a=rng.standard_normal((1, 4, 6, 6)).astype(np.float32),
            b=rng.standard_normal((2, 3, 5, 7)).astype(np.float32),
        )
        out = tmp_path / "r.npz"
        result = run("record", str(model), "--inputs", str(directory), "-o", str(out))
        assert result.exit_code == 0, result.output
        with np.load(out) as data:
            assert sorted(data.files) == [
                "input/a",
                "input/b",
                "output/mean_a",
                "output/mean_b",
                "spec",
            ]

    @pytest.mark.parametrize(
        ("files", "words"),
        [
            ({}, "holds no samples"),
            ({"s.npz": {"wrong": np.zeros(X.shape, np.float32)}}, "the model's inputs are ['x']"),
            ({"s.npy": np.zeros((1, 3, 4, 4), np.float32)}, "sample 1 of 1"),
        ],
    )
    def test_bad_samples_are_one_line(self, tmp_path: Path, files: Any, words: str) -> None:
        model = tmp_path / "model.bin"
        model.write_bytes(affine_model())
        directory = tmp_path / "in"
        directory.mkdir()
        for name, content in files.items():
            if name.endswith(".npz"):
                np.savez(directory / name, **content)
            else:
                np.save(directory / name, content)
        result = run(
            "record", str(model), "--inputs", str(directory), "-o", str(tmp_path / "r.npz")
        )
        assert result.exit_code == 1, result.output
        assert words in result.stderr
        assert "Traceback" not in result.output


@pytest.mark.asyncio
class TestReplay:
    async def test_recorded_inputs_get_the_recorded_outputs(self, recorded: Any) -> None:
        model, out, xs = recorded
        with np.load(out) as data:
            expected = data["output/y"]

        def wrong(inputs: Any) -> Any:
            raise AssertionError("replay answers, not the op")

        runtime = EmulatedRuntime(compute=replay(out))
        async with Engine(model.read_bytes(), runtime=runtime) as engine:
            ys = await asyncio.gather(*(engine.infer(x) for x in xs * 4))
            for index, y in enumerate(ys):
                np.testing.assert_array_equal(y, expected[index % 3])
            with pytest.raises(ComputeError, match=r"no recorded answer for this input.*3 samples"):
                await engine.infer(samples(1, seed=99)[0])
            assert counts_add_up(engine.statistics())
            assert engine.statistics().failures["compute"] == 1
            np.testing.assert_array_equal(await engine.infer(xs[1]), expected[1])

    async def test_through_the_plugin_from_the_recordings_own_spec(
        self, recorded: Any, aiodla_engine: Any
    ) -> None:
        _, out, xs = recorded
        answers = replay(out)
        engine = await aiodla_engine(answers.spec, compute=answers)
        with np.load(out) as data:
            np.testing.assert_array_equal(await engine.infer(xs[2]), data["output/y"][2])

    async def test_a_recording_of_another_model_fails_the_open(self, recorded: Any) -> None:
        _, out, _ = recorded
        engine = Engine(two_pair_model(), runtime=EmulatedRuntime(compute=replay(out)))
        with pytest.raises(ModelError, match="the recording's inputs"):
            await engine.open()

    async def test_a_file_that_is_no_recording(self, tmp_path: Path) -> None:
        path = tmp_path / "x.npz"
        np.savez(path, a=np.zeros(3))
        with pytest.raises(ModelError, match="not a recording"):
            replay(path)


class TestEmulateCompute:
    def test_the_reference_travels_in_the_loadable(self, tmp_path: Path) -> None:
        out = tmp_path / "m.bin"
        result = run(
            "emulate",
            "--input",
            "x:1x3x8x8:float16:chw16",
            "--output",
            "y:1x3x8x8:float32",
            "--compute",
            "support:doubled",
            "-o",
            str(out),
        )
        assert result.exit_code == 0, result.output
        assert "computed by support:doubled" in result.output
        assert parse_loadable(out.read_bytes()).compute == "support:doubled"

        async def infer() -> Any:
            async with Engine(str(out), runtime="emulated", trust_compute=True) as engine:
                return await engine.infer(samples(1)[0])

        y = asyncio.run(infer())
        np.testing.assert_array_equal(y, samples(1)[0].astype(np.float16).astype(np.float32) * 2)

    def test_a_bad_reference_is_a_usage_error(self, tmp_path: Path) -> None:
        result = run(
            "emulate", "--input", "x:1x3x8x8", "--output", "y:1x3x8x8",
            "--compute", "not a reference", "-o", str(tmp_path / "m.bin"),
        )  # fmt: skip
        assert result.exit_code == 2
        assert "MODULE:FUNCTION" in result.output
