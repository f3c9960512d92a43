"""Recorded outputs: ``aiodla record`` on the Jetson, :func:`replay` in CI.

``aiodla record model.bin --inputs DIR -o recording.npz`` runs real inputs through the
model and saves each input with the outputs the DLA gave for it, beside the model
spec. ``compute=replay("recording.npz")`` answers those inputs with those outputs, so
a test can assert on the Jetson's exact numbers with no DLA.

A recording is a numpy ``.npz`` file:

- ``spec``: the model spec (the JSON ``aiodla inspect --json`` writes), as a string;
- ``input/NAME``: one array per input, the samples stacked on a new first axis, each
  as the device read it (after the round trip through its layout: FP16-rounded,
  INT8 as the stored integers);
- ``output/NAME``: the outputs the same way, as the engine returned them.

The input directory of ``aiodla record`` holds one sample per file, taken in the
order of their names: ``*.npz`` files with one array per input name, or, for a model
with one input, ``*.npy`` files with that input's array.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .._errors import AiodlaError, ComputeError, ModelError
from .._tensors import TensorSpec

__all__ = ["Replay", "read_samples", "replay", "seen_by_device", "write_recording"]


def seen_by_device(spec: TensorSpec, array: Any) -> np.ndarray[Any, Any]:
    """``array`` as the DLA reads it: packed in the tensor's layout and read back
    (float types rounded, integers as stored)."""
    raw = spec if spec.scale is None else spec.with_scale(None)
    stored = spec.pack(array)
    return raw.unpack(stored)


def _key(arrays: Sequence[np.ndarray[Any, Any]]) -> bytes:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(str((array.dtype.str, array.shape)).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.digest()


def read_samples(directory: str, inputs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    """The samples in ``directory`` (see the module docstring), in name order."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise ModelError(f"cannot read {directory!r}: {exc.strerror or exc}") from exc
    wanted = [spec.name for spec in inputs]
    samples: list[dict[str, Any]] = []
    for name in names:
        path = os.path.join(directory, name)
        if name.endswith(".npz"):
            with np.load(path, allow_pickle=False) as data:
                sample = {key: data[key] for key in data.files}
            if sorted(sample) != sorted(wanted):
                raise ModelError(
                    f"{path!r} holds arrays {sorted(sample)}; the model's inputs are {wanted}"
                )
            samples.append(sample)
        elif name.endswith(".npy"):
            if len(wanted) != 1:
                raise ModelError(
                    f"{path!r}: a .npy sample is for a model with one input; this one has "
                    f"{wanted}: give one .npz per sample with an array per input"
                )
            samples.append({wanted[0]: np.load(path, allow_pickle=False)})
    if not samples:
        raise ModelError(f"{directory!r} holds no samples (*.npz or *.npy files)")
    return samples


class Recorded(Protocol):
    """What a recording runs on: an :class:`~aiodla.Engine`."""

    @property
    def inputs(self) -> tuple[TensorSpec, ...]: ...
    @property
    def outputs(self) -> tuple[TensorSpec, ...]: ...
    async def infer(self, inputs: Any) -> Any: ...
    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc_info: object) -> None: ...


async def record_samples(
    engine: Callable[..., Recorded],
    model: bytes,
    directory: str,
    runtime: str = "auto",
    *,
    trust_compute: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], tuple[TensorSpec, ...]]:
    """Run the samples in ``directory`` through ``model`` on an engine, one at a time:
    the samples, the outputs by name, and the model's input specs. A sample the engine
    refuses or fails on raises, naming the sample. ``engine`` is :class:`aiodla.Engine`
    (the caller's: the emulator builds on the public API alone); ``trust_compute`` is
    its option of that name (an emulator loadable's compute function runs only with it)."""
    async with engine(model, runtime=runtime, trust_compute=trust_compute) as opened:
        samples = read_samples(directory, opened.inputs)
        results = []
        for index, sample in enumerate(samples):
            try:
                result = await opened.infer(sample)
            except AiodlaError as exc:
                raise AiodlaError(f"sample {index + 1} of {len(samples)}: {exc}") from exc
            if not isinstance(result, dict):
                result = {opened.outputs[0].name: result}
            results.append(result)
        return samples, results, opened.inputs


def write_recording(
    path: str,
    spec: Mapping[str, Any],
    inputs: Sequence[TensorSpec],
    samples: Sequence[Mapping[str, Any]],
    results: Sequence[Mapping[str, Any]],
) -> None:
    """Save the samples (as the device saw them) and their results with the spec."""
    arrays: dict[str, Any] = {"spec": np.array(json.dumps(spec))}
    for tensor in inputs:
        arrays[f"input/{tensor.name}"] = np.stack(
            [seen_by_device(tensor, sample[tensor.name]) for sample in samples]
        )
    for name in results[0]:
        arrays[f"output/{name}"] = np.stack([result[name] for result in results])
    with open(path, "wb") as file:
        np.savez(file, **arrays)


def replay(path: str | os.PathLike[str]) -> Replay:
    """A compute function that answers the inputs of a recording (``aiodla record``)
    with the outputs recorded for them; any other input fails its request with
    :class:`aiodla.ComputeError`. When the engine opens, the recording's tensors must
    be the model's (names and shapes)."""
    return Replay(path)


class Replay:
    """The compute function :func:`replay` returns."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            with np.load(self.path, allow_pickle=False) as data:
                arrays = {key: data[key] for key in data.files}
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read the recording {self.path!r}: {exc}") from exc
        if "spec" not in arrays:
            raise ModelError(f"{self.path!r} is not a recording of 'aiodla record' (no spec)")
        self.spec: dict[str, Any] = json.loads(str(arrays["spec"]))
        self._inputs = {k[6:]: v for k, v in arrays.items() if k.startswith("input/")}
        self._outputs = {k[7:]: v for k, v in arrays.items() if k.startswith("output/")}
        self._names = [entry["name"] for entry in self.spec["inputs"]]
        count = len(next(iter(self._inputs.values())))
        self._answers = {
            _key([self._inputs[name][i] for name in self._names]): i for i in range(count)
        }

    def __repr__(self) -> str:
        return f"replay({self.path!r})"

    def __len__(self) -> int:
        return len(self._answers)

    def check(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
        for kind, specs, recorded in (
            ("input", inputs, self._inputs),
            ("output", outputs, self._outputs),
        ):
            have = {name: tuple(array.shape[1:]) for name, array in recorded.items()}
            want = {spec.name: spec.shape for spec in specs}
            if have != want:
                raise ModelError(
                    f"{self!r}: the recording's {kind}s {have} are not the model's {want}"
                )

    def __call__(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        index = self._answers.get(_key([inputs[name] for name in self._names]))
        if index is None:
            raise ComputeError(
                f"{self!r} has no recorded answer for this input (it holds "
                f"{len(self)} samples; inputs must match one of them bit for bit)"
            )
        return {name: array[index] for name, array in self._outputs.items()}
