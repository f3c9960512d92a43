"""The model spec: a JSON document of a model's tensors, read and written here.

``aiodla inspect --json`` writes it, ``aiodla emulate --like`` and
``aiodla.testing.emulated_model`` read it; one reader means they never disagree.

::

    {"format": "aiodla-model-spec", "version": 1,
     "model": "model.bin", "loadable": "dla" | "emulator",
     "emulator": {"op": ..., "latency": ..., "scale": ..., "bias": ...} | null,
     "inputs": [TENSOR, ...], "outputs": [TENSOR, ...]}

    TENSOR = {"name": ..., "shape": [n, c, h, w], "dtype": ..., "format": ...,
              "strides": [pixel, line, surface, batch], "bytes": ...,
              "descriptor": {"name", "size", "n", "c", "h", "w", "data_format",
                             "data_type", "data_category", "pixel_format",
                             "pixel_mapping", "stride": [8 ints]}}

``descriptor`` holds every field of the loadable's ``cudlaModuleTensorDescriptor``
and is what the readers use; the other fields are aiodla's reading of it, for people
(null, with a ``problem``, where aiodla cannot read the descriptor). A reader refuses a
``version`` it does not know; a later version only adds fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .._descriptors import TensorDescriptor
from .._errors import ModelError
from .._tensors import TensorSpec
from ._format import EmulatorModel, fitting_op

__all__ = [
    "DEFAULT_LATENCY",
    "DESCRIPTOR_FIELDS",
    "SPEC_FORMAT",
    "SPEC_VERSION",
    "fitting_op",
    "is_spec_document",
    "read_spec",
    "read_spec_document",
    "restated",
    "spec_document",
    "tensor_entry",
]

SPEC_FORMAT = "aiodla-model-spec"
SPEC_VERSION = 1
# Seconds one task occupies one core when neither the user nor the spec says.
DEFAULT_LATENCY = 0.001
# Every field of cudlaModuleTensorDescriptor, as TensorDescriptor names them: a spec's
# "descriptor" object holds them all, so `emulate --like` reproduces a tensor exactly.
DESCRIPTOR_FIELDS = tuple(field.name for field in dataclasses.fields(TensorDescriptor))

Descriptors = tuple[list[TensorDescriptor], list[TensorDescriptor], dict[str, Any]]


def tensor_entry(desc: TensorDescriptor) -> dict[str, Any]:
    """One TENSOR of the document: the raw descriptor, and aiodla's reading of it."""
    fields = dataclasses.asdict(desc)
    fields["stride"] = list(desc.stride)
    entry: dict[str, Any] = {"name": desc.name}
    try:
        spec = TensorSpec.from_descriptor(desc)
    except ModelError as exc:
        entry.update(
            shape=[desc.n, desc.c, desc.h, desc.w],
            dtype=None,
            format=None,
            strides=None,
            bytes=desc.size,
            problem=str(exc),
        )
    else:
        assert spec.strides is not None
        entry.update(
            shape=list(spec.shape),
            dtype=spec.dtype,
            format=spec.format,
            strides=list(spec.strides),
            bytes=spec.size,
        )
    entry["descriptor"] = {name: fields[name] for name in DESCRIPTOR_FIELDS}
    return entry


def spec_document(
    path: str,
    descriptors: tuple[Sequence[TensorDescriptor], Sequence[TensorDescriptor]],
    emulator: EmulatorModel | None,
) -> dict[str, Any]:
    """The model spec of the loadable at ``path`` (``emulator`` when it is one)."""
    return {
        "format": SPEC_FORMAT,
        "version": SPEC_VERSION,
        "model": os.path.basename(path),
        "loadable": "dla" if emulator is None else "emulator",
        "emulator": None
        if emulator is None
        else {
            "op": emulator.op,
            "latency": emulator.latency,
            "scale": emulator.scale,
            "bias": emulator.bias,
            "compute": emulator.compute,
        },
        "inputs": [tensor_entry(d) for d in descriptors[0]],
        "outputs": [tensor_entry(d) for d in descriptors[1]],
    }


def is_spec_document(data: bytes) -> bool:
    """Whether ``data`` is JSON naming itself a model spec (whatever else it holds)."""
    if data.lstrip()[:1] != b"{":
        return False  # cheap: a loadable is never read as JSON
    try:
        document = json.loads(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
        return False
    return isinstance(document, Mapping) and document.get("format") == SPEC_FORMAT


def restated(data: bytes, source: str) -> dict[str, Any]:
    """A model spec file's document as this aiodla writes it: every descriptor checked
    (a ModelError names ``source`` otherwise), the readings for people redone."""
    document = json.loads(data)
    inputs, outputs, _settings = read_spec_document(document, source)
    restated = spec_document(str(document.get("model") or source), (inputs, outputs), None)
    restated["loadable"] = document.get("loadable")
    restated["emulator"] = document.get("emulator")
    return restated


def read_spec(path: str) -> Descriptors:
    """The descriptors (inputs, outputs) and emulator settings of a model spec file."""
    try:
        with open(path, encoding="utf-8") as file:
            document = json.load(file)
    except OSError as exc:
        raise ModelError(f"cannot read {path!r}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path!r} is not a JSON model spec: {exc}") from exc
    return read_spec_document(document, repr(path))


def read_spec_document(document: object, source: str = "the model spec") -> Descriptors:
    """The descriptors (inputs, outputs) and emulator settings of a parsed model spec
    (what ``aiodla inspect --json`` writes); ``source`` names it in errors.

    Raises :class:`aiodla.ModelError` for a document that is not a spec this aiodla
    reads.
    """
    if not isinstance(document, Mapping) or document.get("format") != SPEC_FORMAT:
        raise ModelError(
            f'{source} is not an aiodla model spec (no "format": "{SPEC_FORMAT}"); '
            "write one with 'aiodla inspect MODEL --json'"
        )
    version = document.get("version")
    if version != SPEC_VERSION:
        raise ModelError(
            f"{source} is model spec version {version!r}; this aiodla reads version {SPEC_VERSION}"
        )
    tensors = []
    for key in ("inputs", "outputs"):
        entries = document.get(key)
        if not isinstance(entries, list) or not entries:
            raise ModelError(f"{source}: {key!r} must be a non-empty list of tensors")
        tensors.append([_read_descriptor(source, f"{key}[{i}]", e) for i, e in enumerate(entries)])
    emulator = document.get("emulator")
    return tensors[0], tensors[1], dict(emulator) if isinstance(emulator, Mapping) else {}


def _read_descriptor(source: str, where: str, entry: object) -> TensorDescriptor:
    fields = entry.get("descriptor") if isinstance(entry, dict) else None
    if not isinstance(fields, dict):
        raise ModelError(f'{source}: {where} has no "descriptor" object')
    missing = [name for name in DESCRIPTOR_FIELDS if name not in fields]
    if missing:
        raise ModelError(f"{source}: {where}.descriptor lacks {', '.join(missing)}")
    name = fields["name"]
    if not isinstance(name, str) or not name:
        raise ModelError(f"{source}: {where}.descriptor.name must be a non-empty string")
    numbers = {}
    for field in DESCRIPTOR_FIELDS[1:-1]:
        value = fields[field]
        if not _is_count(value):
            raise ModelError(
                f"{source}: {where}.descriptor.{field} must be an integer >= 0, got {value!r}"
            )
        numbers[field] = value
    stride = fields["stride"]
    if not isinstance(stride, list) or len(stride) != 8 or not all(map(_is_count, stride)):
        raise ModelError(f"{source}: {where}.descriptor.stride must be 8 integers >= 0")
    return TensorDescriptor(name=name, stride=tuple(stride), **numbers)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
