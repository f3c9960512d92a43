"""The emulator op mix: its definition, the models it makes emulable, its guarantees.

The reference below is the format docstring's definition written out on Python ints,
one element at a time, independently of aiodla.emulator._ops' vectorized numpy; the
shared vectors (tests/vectors.py) hold the stand-in to the same bytes.
"""

from __future__ import annotations

import asyncio
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from aiodla import EmulatedRuntime, Engine, TensorSpec, _cli
from aiodla.emulator import make_loadable, parse_loadable
from aiodla.emulator._format import EmulatorModel
from aiodla.emulator._ops import compute_outputs, run_model

from vectors import SplitMix64, vectors

M64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15


def finalize(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference(model: EmulatorModel, stored: list[np.ndarray[Any, Any]]) -> list[list[float]]:
    """The format's mix, element by element, as stored values (floats, for comparing)."""
    digest = 0
    for t, x in enumerate(stored):
        seed = finalize(0x41494F444C41 + t)
        width = x.dtype.itemsize
        total = 0
        for j, raw in enumerate(
            x.tobytes(order="C")[i : i + width] for i in range(0, x.nbytes, width)
        ):
            weight = finalize((seed + (j + 1) * G) & M64) | 1
            total = (total + int.from_bytes(raw, "little") * weight) & M64
        digest = finalize((digest + total + G) & M64)
    results = []
    for o, spec in enumerate(model.outputs):
        key = finalize((digest + (o + 1) * 0xD1B54A32D192ED03) & M64)
        dtype = spec.numpy_dtype
        values = []
        for i in range(math.prod(spec.shape)):
            k = finalize((key + (i + 1) * G) & M64) >> 48
            if dtype.kind == "f":
                v = k * 2.0**-15 - 1
            elif dtype.itemsize == 1:
                v = (k >> 8) - (128 if dtype.kind == "i" else 0)
            else:
                v = k - (32768 if dtype.kind == "i" else 0)
            y = model.scale * v + model.bias
            if dtype.kind == "f":
                limit = float(np.finfo(dtype).max)
                y = min(max(y, -limit), limit)
                values.append(float(np.array(y).astype(dtype)))
            else:
                info = np.iinfo(dtype)
                values.append(float(min(max(round(y), int(info.min)), int(info.max))))
        results.append(values)
    return results


MIX_VECTORS = [v for v in vectors(requests=2) if v.model.op == "mix"]


@pytest.mark.parametrize("vector", MIX_VECTORS, ids=[v.name for v in MIX_VECTORS])
def test_numpy_follows_the_written_definition(vector: Any) -> None:
    for arrays in vector.arrays:
        got = compute_outputs(vector.model, list(arrays))
        want = reference(vector.model, list(arrays))
        for spec, have, expected in zip(vector.model.outputs, got, want, strict=True):
            assert have.shape == spec.shape and have.dtype == spec.numpy_dtype
            np.testing.assert_array_equal(have.astype(np.float64).ravel(), expected, spec.name)


def test_outputs_stay_finite_and_in_range() -> None:
    x = TensorSpec("x", (1, 3, 4, 4), "float16")
    outs = [TensorSpec(f"o_{d}", (1, 64, 8, 8), d) for d in ("float16", "float32", "int8")]
    rng = np.random.default_rng(1)
    x_value = [rng.standard_normal((1, 3, 4, 4)).astype(np.float16)]
    plain = compute_outputs(parse_loadable(make_loadable([x], outs, "mix")), x_value)
    for y in plain[:2]:
        assert -1 <= y.min() < -0.99 and 0.99 < y.max() <= 1  # [-1, 1), float16 rounds up to 1
    assert (plain[2].min(), plain[2].max()) == (-128, 127)  # the whole int8 range
    huge = compute_outputs(parse_loadable(make_loadable([x], outs, "mix", scale=1e40)), x_value)
    assert np.isfinite(huge[0]).all() and np.abs(huge[0]).max() == 65504
    assert np.isfinite(huge[1]).all()
    assert set(np.unique(huge[2])) == {-128, 0, 127}  # saturates as the DLA would (v = 0: 0)


def test_a_changed_input_element_changes_almost_every_output() -> None:
    """Every element of every input, one at a time, including a change of sign of zero."""
    inputs = [
        TensorSpec("a", (1, 3, 4, 5), "float16", "chw16"),
        TensorSpec("b", (1, 2, 3, 3), "int8"),
    ]
    outputs = [TensorSpec("y", (1, 50, 2, 2), "float16"), TensorSpec("z", (1, 100, 1, 1), "uint8")]
    model = parse_loadable(make_loadable(inputs, outputs, "mix"))
    rng = np.random.default_rng(7)
    base = [
        rng.standard_normal((1, 3, 4, 5)).astype(np.float16),
        rng.integers(-128, 128, (1, 2, 3, 3)).astype(np.int8),
    ]
    first = compute_outputs(model, base)
    for t, x in enumerate(base):
        for j in range(x.size):
            changed = [a.copy() for a in base]
            flat = changed[t].reshape(-1)
            flat[j] = -flat[j] if flat[j] != 0 else 1
            if t == 0 and j == 0:
                flat[j] = np.float16(0.0) if base[0].flat[0] else np.float16(-0.0)
            again = compute_outputs(model, changed)
            assert (again[0] != first[0]).mean() > 0.9, (t, j)
            assert (again[1] != first[1]).mean() > 0.9, (t, j)


def test_swapped_inputs_of_one_shape_give_other_outputs() -> None:
    a, b = TensorSpec("a", (1, 4, 2, 2), "float16"), TensorSpec("b", (1, 4, 2, 2), "float16")
    model = parse_loadable(make_loadable([a, b], [TensorSpec("y", (1, 64, 1, 1))], "mix"))
    x1 = np.arange(16, dtype=np.float16).reshape(a.shape)
    x2 = -x1
    one, two = compute_outputs(model, [x1, x2]), compute_outputs(model, [x2, x1])
    assert (one[0] != two[0]).mean() > 0.9


def test_the_emulated_runtime_writes_the_same_values_in_the_layout() -> None:
    """run_model (what the emulated runtime calls) packs compute_outputs' values."""
    vector = MIX_VECTORS[0]
    outputs = [np.full(s.size, 0xAB, np.uint8) for s in vector.model.outputs]
    run_model(vector.model, [np.frombuffer(b, np.uint8) for b in vector.buffers[0]], outputs)
    for spec, raw, want in zip(
        vector.model.outputs,
        outputs,
        compute_outputs(vector.model, list(vector.arrays[0])),
        strict=True,
    ):
        np.testing.assert_array_equal(spec.unpack(raw), want)


# -- the issue's three models -------------------------------------------------------------

RESNET = (
    ["--input", "resnetv17_pool0_fwd:1x64x56x56:float16:chw16"],
    ["--output", "resnetv17_stage4_activation2:1x2048x7x7:float16:chw16"],
)
CLASSIFIER = (
    ["--input", "data:1x3x224x224:int8:hwc4"],
    ["--output", "logits:1x1000x1x1:float16:nchw"],
)
DETECTOR = (
    ["--input", "images:1x3x640x640:float16:chw16"],
    [
        *("--output", "p3:1x255x80x80:float16:chw16"),
        *("--output", "p4:1x255x40x40:float16:chw16"),
        *("--output", "p5:1x255x20x20:float16:chw16"),
    ],
)
MODELS = {"resnet50_slice": RESNET, "classifier": CLASSIFIER, "detector": DETECTOR}


def random_input(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    if spec.numpy_dtype.kind == "f":
        return rng.standard_normal(spec.shape).astype(spec.numpy_dtype)
    return rng.integers(-128, 128, spec.shape).astype(spec.numpy_dtype)


@pytest.mark.parametrize("name", MODELS)
def test_the_issues_models_emulate_and_run(name: str, tmp_path: Path) -> None:
    ins, outs = MODELS[name]
    path = tmp_path / f"{name}.bin"
    result = CliRunner().invoke(_cli.cli, ["emulate", *ins, *outs, "-o", str(path)])
    assert result.exit_code == 0, result.output
    assert "op mix" in result.output
    model = parse_loadable(path.read_bytes())
    rng = np.random.default_rng(len(name))
    first = {s.name: random_input(s, rng) for s in model.inputs}
    second = {s.name: random_input(s, rng) for s in model.inputs}

    async def main() -> list[Any]:
        async with Engine(path.read_bytes(), runtime=EmulatedRuntime(cores=2)) as engine:
            return list(
                await asyncio.gather(engine.infer(first), engine.infer(second), engine.infer(first))
            )

    one, two, again = (
        r if isinstance(r, dict) else {model.outputs[0].name: r} for r in asyncio.run(main())
    )
    flipped = {k: v.copy() for k, v in first.items()}
    spec = model.inputs[0]
    flipped[spec.name].reshape(-1)[12345] += 1  # one element, as stored
    changed = dict(
        zip(
            (s.name for s in model.outputs),
            compute_outputs(model, list(flipped.values())),
            strict=True,
        )
    )
    for out in model.outputs:
        assert one[out.name].shape == out.shape
        np.testing.assert_array_equal(one[out.name], again[out.name])  # deterministic
        assert np.isfinite(one[out.name].astype(np.float64)).all()
        assert (one[out.name] != two[out.name]).mean() > 0.99  # other request, other numbers
        assert (one[out.name] != changed[out.name]).mean() > 0.99  # one input element


def test_emulate_reports_sizes_no_op_fits_no_more(tmp_path: Path) -> None:
    """A shape no paired op fits is mix; an explicit paired op that does not fit fails."""
    path = tmp_path / "m.bin"
    ins, outs = CLASSIFIER
    bad = CliRunner().invoke(_cli.cli, ["emulate", *ins, *outs, "--op", "affine", "-o", str(path)])
    assert bad.exit_code != 0 and "must have shape" in bad.output
    good = CliRunner().invoke(_cli.cli, ["emulate", *ins, *outs, "--op", "auto", "-o", str(path)])
    assert good.exit_code == 0 and "op mix" in good.output


def test_struct_of_the_header_names_mix() -> None:
    data = make_loadable(
        [TensorSpec("x", (1, 3, 4, 4))],
        [TensorSpec("y", (1, 10, 1, 1)), TensorSpec("z", (1, 2, 2, 2))],
    )
    _, _, _, n_in, n_out, op, params = struct.unpack_from("<8s6I", data)
    assert (n_in, n_out, op, params) == (1, 2, 3, 2)


def test_a_rng_sanity() -> None:
    assert SplitMix64(0).next() == finalize(G)
