"""From a described model to an emulator loadable the emulated runtime runs.

A user's CI has no DLA, but it has the model's I/O: the spec that ``aiodla inspect
model.bin --json`` writes on a Jetson, or TensorSpecs written by hand. The spec is read
by ``aiodla.emulator._spec``, the reader ``aiodla emulate --like`` uses too, so the
two never disagree about the format.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import ModelError
from .._tensors import TensorSpec
from ..emulator._format import AUTO, OPS, is_emulator_loadable, make_loadable, parse_loadable
from ..emulator._spec import DEFAULT_LATENCY, read_spec, read_spec_document

__all__ = ["ModelDescription", "emulated_model"]

ModelDescription = str | os.PathLike[str] | Mapping[str, Any] | bytes
"""A model spec file (``aiodla inspect --json``), its parsed JSON, or loadable bytes."""

# How errors name a spec that did not come from a file.
_DOCUMENT = "the model spec"


def emulated_model(
    spec: ModelDescription | None = None,
    *,
    inputs: Sequence[TensorSpec] | None = None,
    outputs: Sequence[TensorSpec] | None = None,
    latency: float | None = None,
    op: str | None = None,
    scale: float | None = None,
    bias: float | None = None,
) -> bytes:
    """An emulator loadable with the I/O of a described model.

    Describe the model by ``spec`` — a model spec file written by ``aiodla inspect
    MODEL --json``, that JSON already parsed (a dict), or emulator loadable bytes — or
    by ``inputs`` and ``outputs`` (TensorSpecs, output i paired with input i).

    ``latency`` is the seconds one task occupies one DLA core; ``op`` (``"affine"``:
    ``y = scale * x + bias``; ``"mean_hw"``: the same on x's mean over H and W, both
    output i from input i; ``"mix"``: any inputs and outputs, each output element a
    hash of every input element and of its own position, in [-1, 1) for float types
    and over the whole range for integer ones, before ``scale`` and ``bias``; or
    ``"auto"``) with ``scale`` and ``bias`` says what the outputs are. Each defaults to
    the spec's own emulator settings when it has them, else to 1 ms, ``"auto"``
    (affine or mean_hw when the shapes fit, else mix), 1 and 0.

    Raises :class:`aiodla.ModelError` for a spec aiodla cannot read.
    """
    if (inputs is None) != (outputs is None):
        raise TypeError("give both inputs= and outputs=, or neither")
    if (spec is None) == (inputs is None):
        raise TypeError("describe the model by a spec, or by inputs= and outputs=, not both")
    settings: Mapping[str, Any] = {}
    if inputs is not None and outputs is not None:
        ins, outs = _checked_specs(inputs, "inputs"), _checked_specs(outputs, "outputs")
    elif isinstance(spec, (bytes, bytearray, memoryview)):
        if not is_emulator_loadable(spec):
            raise ModelError(
                "these bytes are a DLA loadable, which only a DLA runs; on the Jetson, "
                "write its spec with 'aiodla inspect MODEL --json' and describe the model "
                "by that spec"
            )
        model = parse_loadable(spec)
        ins, outs = model.inputs, model.outputs
        settings = {
            "op": model.op,
            "latency": model.latency,
            "scale": model.scale,
            "bias": model.bias,
        }
    else:
        assert spec is not None
        ins, outs, settings = _read(spec)
    if op is not None and op != AUTO and op not in OPS:
        raise ModelError(f"op={op!r} is unknown; expected one of {sorted([AUTO, *OPS])}")
    chosen = op or (settings.get("op") if settings.get("op") in OPS else None) or AUTO
    return make_loadable(
        ins,
        outs,
        chosen,
        latency=_number(latency, settings, "latency", DEFAULT_LATENCY),
        scale=_number(scale, settings, "scale", 1.0),
        bias=_number(bias, settings, "bias", 0.0),
    )


def _checked_specs(specs: Sequence[TensorSpec], what: str) -> tuple[TensorSpec, ...]:
    specs = tuple(specs)
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"{what} must be TensorSpecs, got {type(spec).__name__}")
    return specs


def _read(
    spec: str | os.PathLike[str] | Mapping[str, Any],
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], Mapping[str, Any]]:
    if isinstance(spec, Mapping):
        input_descs, output_descs, settings = read_spec_document(spec, _DOCUMENT)
    elif isinstance(spec, (str, os.PathLike)):
        input_descs, output_descs, settings = read_spec(os.fspath(spec))
    else:
        raise TypeError(
            "spec must be a model spec file, its JSON as a dict, or emulator loadable "
            f"bytes; got {type(spec).__name__}"
        )
    ins = tuple(TensorSpec.from_descriptor(d) for d in input_descs)
    outs = tuple(TensorSpec.from_descriptor(d) for d in output_descs)
    return ins, outs, settings


def _number(given: float | None, settings: Mapping[str, Any], key: str, default: float) -> float:
    if given is not None:
        return float(given)
    value = settings.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return default
