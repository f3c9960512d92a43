"""``aiodla verify``: does this loadable give the right answers, on every core, at the
speed expected? The report a user attaches to a bug.

1. Inputs: the ``--input NAME=FILE.npy`` arrays, else ``samples`` generated ones (a
   fixed seed), of the names, shapes and precisions the loadable's descriptors give.
2. Each core alone (an engine on that core): every sample, and the outputs' bytes
   held against the first core's: the cores must agree to the byte.
3. With ``--onnx``: onnxruntime runs the ONNX model on what the DLA reads (FP16-rounded,
   or quantized with the tensor's scale); the I/O is matched by name (a clear error when
   the names differ), and per output the max absolute and relative error, the cosine
   similarity and, for a classifier (an NxCx1x1 output, C > 1), top-1 agreement are
   judged against :data:`TOLERANCES` for the model's precision.
4. Latency per core, one request at a time (median, p99), and the engine's throughput
   on all the cores against ``cores / median latency``.
5. The versions ``aiodla doctor`` reads.

The relative error is the max absolute error over the reference's largest magnitude
(one figure per output, stable where the reference crosses zero).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._doctor import Host, diagnose
from ._engine import Engine
from ._errors import AiodlaError, ModelError
from ._safe_paths import read_limited
from ._tensors import TensorSpec
from .emulator._onnx import OnnxCompute

__all__ = ["TOLERANCES", "Tolerance", "VerifyError", "VerifySettings", "verify"]


class VerifyError(AiodlaError, ValueError):
    """The loadable and what verify was given do not fit (I/O names, input files)."""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """What an output must meet against onnxruntime to pass."""

    max_rel: float
    min_cosine: float
    min_top1: float


#: By the model's precision: INT8 when any of its tensors is 8-bit, else FP16.
TOLERANCES = {
    "fp16": Tolerance(max_rel=0.02, min_cosine=0.999, min_top1=0.95),
    "int8": Tolerance(max_rel=0.10, min_cosine=0.99, min_top1=0.90),
}


@dataclasses.dataclass(frozen=True)
class VerifySettings:
    model: str
    onnx: str | None = None
    export: str | None = None  # the full detector export the model was compiled from
    inputs: Mapping[str, str] = dataclasses.field(default_factory=dict)  # name -> .npy
    scales: Mapping[str, float] = dataclasses.field(default_factory=dict)
    cores: tuple[int, ...] = (0, 1)
    runtime: str = "auto"
    trust_compute: bool = False
    samples: int = 8
    latency_requests: int = 100
    throughput_requests: int = 400
    timeout: float = 30.0  # the doctor's probes


async def verify(data: bytes, settings: VerifySettings) -> dict[str, Any]:
    """Run every step; returns the report document (see ``report_markdown``). Raises
    :class:`VerifyError` when the inputs or the ONNX model do not fit the loadable."""
    options: dict[str, Any] = {
        "runtime": settings.runtime,
        "trust_compute": settings.trust_compute,
        "scales": dict(settings.scales),
    }
    per_core: dict[int, list[dict[str, np.ndarray[Any, Any]]]] = {}
    latency: dict[int, list[float]] = {}
    specs: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] | None = None
    samples: list[dict[str, np.ndarray[Any, Any]]] = []
    generated: list[str] = []
    runtime = settings.runtime
    network: OnnxCompute | None = None
    for core in settings.cores:
        async with Engine(data, cores=[core], streams_per_core=1, **options) as engine:
            if specs is None:
                specs = (engine.inputs, engine.outputs)
                samples, generated = _inputs(engine.inputs, settings)
                runtime = engine.runtime.name
                # Before any measuring: an ONNX model that does not fit fails at once.
                network = _network(settings.onnx, *specs) if settings.onnx else None
            outputs = [_named(engine, await engine.infer(dict(s))) for s in samples]
            per_core[core] = outputs
            latency[core] = await _latencies(engine, samples[0], settings.latency_requests)
    assert specs is not None  # cores is never empty: the CLI and the settings say so
    inputs, outputs_specs = specs
    async with Engine(data, cores=list(settings.cores), **options) as engine:
        rate, ran, concurrency = await _throughput(engine, samples[0], settings.throughput_requests)
        service = engine.stated_service_time
    precision = _precision(inputs, outputs_specs)
    first = settings.cores[0]
    document: dict[str, Any] = {
        "schema": "aiodla-verify/1",
        "model": settings.model,
        "onnx": settings.onnx,
        "cores": list(settings.cores),
        "precision": precision,
        "runtime": runtime,
        "inputs": [_describe(spec, spec.name in generated) for spec in inputs],
        "outputs": [_describe(spec, False) for spec in outputs_specs],
        "samples": len(samples),
        "cores_agree": _agreement(per_core, first),
        "latency": {str(core): _summary(values) for core, values in latency.items()},
    }
    median = float(np.median([np.median(v) for v in latency.values()]))
    ideal = len(settings.cores) / median
    document["throughput"] = {
        "requests": ran,
        "concurrency": concurrency,
        "requests_per_second": rate,
        "ideal": ideal,
        "ratio": rate / ideal,
        "stated_service_time": service,
    }
    checks = [document["cores_agree"]["identical"]]
    if network is not None:
        reference = _reference(network, inputs, outputs_specs, samples)
        tolerance = TOLERANCES[precision]
        document["tolerance"] = dataclasses.asdict(tolerance)
        document["comparison"] = [
            _compare(spec, [o[spec.name] for o in per_core[first]], reference[spec.name], tolerance)
            for spec in outputs_specs
        ]
        checks.extend(entry["pass"] for entry in document["comparison"])
    if settings.export is not None:
        from ._verify_export import ExportError, against_export

        try:
            document["detections"] = await against_export(
                data, settings.model, settings.export, samples if not generated else None,
                settings.cores, precision, options, count=len(samples),
            )  # fmt: skip
        except ExportError as exc:
            raise VerifyError(str(exc)) from exc
        checks.append(document["detections"]["pass"])
    doctor = diagnose(Host(timeout=settings.timeout))
    document["versions"] = doctor.versions
    document["platform"] = dataclasses.asdict(doctor.platform)
    document["verdict"] = "pass" if all(checks) else "fail"
    return document


# -- inputs ------------------------------------------------------------------------------


def _inputs(
    specs: Sequence[TensorSpec], settings: VerifySettings
) -> tuple[list[dict[str, np.ndarray[Any, Any]]], list[str]]:
    """The samples, and the names of the inputs that were generated."""
    names = {spec.name for spec in specs}
    unknown = sorted(set(settings.inputs) - names)
    if unknown:
        raise VerifyError(
            f"--input names {unknown} are not inputs of {settings.model!r}; its inputs are "
            f"{sorted(names)}"
        )
    given = {name: _load(name, path) for name, path in settings.inputs.items()}
    count = 1 if given else settings.samples
    rng = np.random.default_rng(2024)
    samples = []
    for _ in range(count):
        sample = {}
        for spec in specs:
            sample[spec.name] = given[spec.name] if spec.name in given else _generate(spec, rng)
        samples.append(sample)
    return samples, [spec.name for spec in specs if spec.name not in given]


#: An input sample is a frame or a tensor: a few megabytes, far below this.
INPUT_FILE_LIMIT = 1 << 30


def _load(name: str, path: str) -> np.ndarray[Any, Any]:
    try:
        # A regular file, opened without waiting (a FIFO is refused) and read bounded.
        data = read_limited(os.fspath(path), INPUT_FILE_LIMIT)
        return np.asarray(np.load(io.BytesIO(data), allow_pickle=False))
    except (OSError, ValueError) as exc:
        raise VerifyError(f"--input {name}={path}: cannot read a .npy array: {exc}") from exc


def _generate(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    if spec.is_integer and spec.scale is None:  # stored integers: the DLA's own values
        info = np.iinfo(spec.numpy_dtype)
        low, high = max(int(info.min), -100), min(int(info.max), 100)
        return rng.integers(low, high, spec.shape, endpoint=True).astype(spec.numpy_dtype)
    return rng.standard_normal(spec.shape).astype(np.float32)


def _named(engine: Engine, result: Any) -> dict[str, np.ndarray[Any, Any]]:
    if isinstance(result, Mapping):
        return {name: np.asarray(array) for name, array in result.items()}
    return {engine.outputs[0].name: np.asarray(result)}


def _device_view(spec: TensorSpec, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """What the DLA reads of ``array``, as real values: FP16-rounded, or quantized with
    the tensor's scale (round to nearest, saturate) and scaled back."""
    if not spec.is_integer:
        return array.astype(spec.numpy_dtype).astype(np.float32)
    if spec.scale is None:
        return array.astype(np.float32)
    info = np.iinfo(spec.numpy_dtype)
    stored = np.clip(np.rint(array.astype(np.float64) / spec.scale), info.min, info.max)
    return (stored * spec.scale).astype(np.float32)


# -- measuring ---------------------------------------------------------------------------


async def _latencies(engine: Engine, sample: Mapping[str, Any], count: int) -> list[float]:
    await engine.infer(dict(sample))  # the first request's one-off work is no latency
    values = []
    for _ in range(count):
        started = time.perf_counter()
        await engine.infer(dict(sample))
        values.append(time.perf_counter() - started)
    return values


async def _throughput(
    engine: Engine, sample: Mapping[str, Any], count: int
) -> tuple[float, int, int]:
    """(requests a second, the requests timed, how many at a time): ``count`` requests,
    counted by the engine as they complete (a warm-up request before them is not)."""
    concurrency = max(1, 2 * engine.options.streams_per_core * len(engine.options.cores))
    shares = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]

    async def worker(n: int) -> None:
        for _ in range(n):
            await engine.infer(dict(sample))

    await engine.infer(dict(sample))
    before = engine.statistics().completed
    started = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in shares))
    elapsed = time.perf_counter() - started
    ran = engine.statistics().completed - before
    return ran / elapsed, ran, min(concurrency, count)


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "median_ms": float(np.median(values)) * 1e3,
        "p99_ms": float(np.percentile(values, 99)) * 1e3,
        "requests": len(values),
    }


def _agreement(
    per_core: Mapping[int, Sequence[Mapping[str, np.ndarray[Any, Any]]]], first: int
) -> dict[str, Any]:
    differences = []
    for core, outputs in per_core.items():
        for index, (mine, theirs) in enumerate(zip(outputs, per_core[first], strict=True)):
            for name, array in mine.items():
                if array.tobytes() != theirs[name].tobytes():
                    gap = np.abs(array.astype(np.float64) - theirs[name].astype(np.float64))
                    differences.append(
                        {"core": core, "sample": index, "output": name, "max_abs": float(gap.max())}
                    )
    return {"identical": not differences, "against": first, "differences": differences}


# -- the reference -------------------------------------------------------------------------


def _network(onnx: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> OnnxCompute:
    """onnxruntime on ``onnx``, its I/O matched to the loadable's by name."""
    network = OnnxCompute(onnx)
    onnx_in, onnx_out = sorted(network.input_names), sorted(network.output_names)
    dla_in, dla_out = sorted(s.name for s in inputs), sorted(s.name for s in outputs)
    missing_out = sorted(set(dla_out) - set(onnx_out))
    if dla_in != onnx_in or missing_out:
        raise VerifyError(
            f"the I/O of {onnx!r} does not match the loadable's by name: the loadable's "
            f"inputs {dla_in} and outputs {dla_out}, the ONNX model's inputs {onnx_in} and "
            f"outputs {onnx_out}; export the ONNX model the loadable was built from"
        )
    try:
        network.check(tuple(inputs), tuple(outputs))
    except ModelError as exc:
        raise VerifyError(str(exc)) from exc
    return network


def _reference(
    network: OnnxCompute,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    samples: Sequence[Mapping[str, np.ndarray[Any, Any]]],
) -> dict[str, list[np.ndarray[Any, Any]]]:
    """The network's outputs for what the DLA reads of each sample."""
    by_spec = {spec.name: spec for spec in inputs}
    results: dict[str, list[np.ndarray[Any, Any]]] = {spec.name: [] for spec in outputs}
    for sample in samples:
        seen = {name: _device_view(by_spec[name], array) for name, array in sample.items()}
        for name, array in network(seen).items():
            results[name].append(np.asarray(array))
    return results


def _precision(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> str:
    eight_bit = any(spec.numpy_dtype.itemsize == 1 for spec in (*inputs, *outputs))
    return "int8" if eight_bit else "fp16"


def _compare(
    spec: TensorSpec,
    got: Sequence[np.ndarray[Any, Any]],
    want: Sequence[np.ndarray[Any, Any]],
    tolerance: Tolerance,
) -> dict[str, Any]:
    y = np.stack([np.asarray(a, np.float64) for a in got])
    r = np.stack([np.asarray(a, np.float64).reshape(spec.shape) for a in want])
    gap = np.abs(y - r)
    max_abs = float(gap.max())
    scale = float(np.abs(r).max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    norms = float(np.linalg.norm(y) * np.linalg.norm(r))
    cosine = float(np.vdot(y, r) / norms) if norms > 0 else (1.0 if max_abs == 0 else 0.0)
    entry: dict[str, Any] = {
        "output": spec.name,
        "max_abs": max_abs,
        "max_rel": max_rel,
        "cosine": cosine,
        "top1": None,
    }
    failures = []
    if not max_rel <= tolerance.max_rel:
        failures.append(f"max relative error {max_rel:.3g} > {tolerance.max_rel:g}")
    if not cosine >= tolerance.min_cosine:
        failures.append(f"cosine similarity {cosine:.6f} < {tolerance.min_cosine:g}")
    n, c, h, w = spec.shape
    if c > 1 and h == w == 1:  # a classifier's scores: one per class
        agree = y.reshape(-1, n, c).argmax(-1) == r.reshape(-1, n, c).argmax(-1)
        entry["top1"] = float(agree.mean())
        if not entry["top1"] >= tolerance.min_top1:
            failures.append(f"top-1 agreement {entry['top1']:.3f} < {tolerance.min_top1:g}")
    entry["pass"] = not failures
    entry["failures"] = failures
    return entry


def _describe(spec: TensorSpec, generated: bool) -> dict[str, Any]:
    return {
        "name": spec.name,
        "shape": list(spec.shape),
        "dtype": spec.dtype,
        "format": spec.format,
        "scale": spec.scale,
        "source": "generated" if generated else "given",
    }
