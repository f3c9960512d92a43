"""A reference network as the emulated runtime's compute function: :func:`onnx_compute`.

The workflow: the ONNX file that ``trtexec`` compiled into the DLA loadable, plus the
model spec ``aiodla inspect model.bin --json`` captured on the Jetson. In CI,
``compute=onnx_compute("model.onnx")`` runs the real network's numbers (onnxruntime
on the CPU) through aiodla's queueing, layouts and faults. Needs ``aiodla[onnx]``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import ConfigurationError, ModelError
from .._tensors import TensorSpec

__all__ = ["OnnxCompute", "onnx_compute"]

# ONNX element types as numpy dtypes (the ones a DLA tensor can map to).
_ONNX_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(int16)": np.int16,
    "tensor(uint16)": np.uint16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
}


def onnx_compute(
    model: str | os.PathLike[str] | bytes,
    *,
    names: Mapping[str, str] | None = None,
    providers: Sequence[str] = ("CPUExecutionProvider",),
) -> OnnxCompute:
    """A compute function that runs the ONNX network ``model`` (a path or its bytes)
    with onnxruntime.

    Tensors are matched by name; ``names`` maps a DLA tensor's name to the ONNX
    tensor's where they differ. When the engine opens, every DLA input and output
    must have an ONNX counterpart whose static dimensions fit its shape (an ONNX
    shape of fewer than four dimensions is padded with trailing 1s: ``[1, 1000]`` is
    the DLA's 1x1000x1x1); otherwise the open fails with :class:`aiodla.ModelError`.
    Inputs are cast to the ONNX input's type (the FP16-rounded values the DLA would
    read); outputs are reshaped to the DLA's shape and stored in its type.
    """
    return OnnxCompute(model, names=names, providers=providers)


class OnnxCompute:
    """The compute function :func:`onnx_compute` returns.

    ``external_data=False`` (an emulator loadable's own network) refuses a model whose
    weights point at files: a loadable is data, and must not make the runtime read
    other files."""

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes,
        *,
        names: Mapping[str, str] | None = None,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        external_data: bool = True,
    ) -> None:
        try:
            import onnxruntime  # noqa: F401  (here, for the clear error below)
        except ImportError as exc:
            raise ConfigurationError(
                "onnx_compute needs onnxruntime: pip install 'aiodla[onnx]'"
            ) from exc
        source: Any = bytes(model) if isinstance(model, (bytes, bytearray)) else os.fspath(model)
        self.source = "<bytes>" if isinstance(source, bytes) else source
        if not external_data:
            _refuse_external_data(source)
        self._model = source
        self._providers = list(providers)
        self._names = dict(names or {})
        self._load({})
        self._plan: tuple[list[tuple[str, str, Any]], list[tuple[str, str, tuple[int, ...]]]]
        self._plan = ([], [])
        self._checked = False

    def __repr__(self) -> str:
        return f"onnx_compute({self.source!r})"

    def _load(self, dimensions: Mapping[str, int]) -> None:
        """A session with the named free dimensions fixed, so that onnxruntime infers
        the outputs' shapes from the inputs' before anything runs."""
        import onnxruntime

        options = onnxruntime.SessionOptions()
        for name, value in dimensions.items():
            options.add_free_dimension_override_by_name(name, value)
        try:
            self._session = onnxruntime.InferenceSession(
                self._model, options, providers=self._providers
            )
        except Exception as exc:
            raise ModelError(f"onnxruntime cannot load {self.source!r}: {exc}") from exc
        self._onnx_inputs = {i.name: i for i in self._session.get_inputs()}
        self._onnx_outputs = {o.name: o for o in self._session.get_outputs()}

    @property
    def input_names(self) -> tuple[str, ...]:
        """The ONNX network's input names."""
        return tuple(self._onnx_inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        """The ONNX network's output names."""
        return tuple(self._onnx_outputs)

    def check(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
        """At the engine's open: every DLA tensor has an ONNX counterpart that fits.

        The ONNX inputs' named free dimensions (a batch ``N``) take the DLA inputs'
        sizes first, so an output whose shape follows from them is checked too, before
        the network ever runs (an output of the wrong size would otherwise be found
        only after computing it, however large).
        """
        feeds = [self._match(spec, self._onnx_inputs, "input") for spec in inputs]
        dimensions = self._free_dimensions(inputs, feeds)
        if dimensions:
            self._load(dimensions)
            feeds = [self._match(spec, self._onnx_inputs, "input") for spec in inputs]
        fetches = [self._match(spec, self._onnx_outputs, "output") for spec in outputs]
        self._plan = (
            [
                (spec.name, arg.name, _numpy_type(arg))
                for spec, arg in zip(inputs, feeds, strict=True)
            ],
            [(spec.name, arg.name, spec.shape) for spec, arg in zip(outputs, fetches, strict=True)],
        )
        self._checked = True

    def _free_dimensions(
        self, inputs: Sequence[TensorSpec], feeds: Sequence[Any]
    ) -> dict[str, int]:
        dimensions: dict[str, int] = {}
        for spec, arg in zip(inputs, feeds, strict=True):
            dims = list(arg.shape)
            for dim, size in zip([*dims, *[1] * (4 - len(dims))], spec.shape, strict=True):
                if not isinstance(dim, str):
                    continue
                if dimensions.setdefault(dim, size) != size:
                    raise ModelError(
                        f"onnx_compute({self.source!r}): ONNX dimension {dim!r} would be "
                        f"both {dimensions[dim]} and {size} for the model's inputs"
                    )
        return dimensions

    def _match(self, spec: TensorSpec, found: Mapping[str, Any], kind: str) -> Any:
        name = self._names.get(spec.name, spec.name)
        arg = found.get(name)
        if arg is None:
            raise ModelError(
                f"onnx_compute({self.source!r}): the model's {kind} {spec.name!r} has no "
                f"ONNX {kind} {name!r} (the network's {kind}s are {sorted(found)}); map "
                "names with names={dla_name: onnx_name}"
            )
        dims = list(arg.shape)
        if len(dims) > 4 or any(
            isinstance(d, int) and d != s
            for d, s in zip([*dims, *[1] * (4 - len(dims))], spec.shape, strict=True)
        ):
            raise ModelError(
                f"onnx_compute({self.source!r}): ONNX {kind} {name!r} has shape {dims}, "
                f"which does not fit the model's {spec.shape} (n, c, h, w)"
            )
        _numpy_type(arg)
        return arg

    def __call__(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        feeds: list[tuple[str, str, Any]]
        fetch: list[tuple[str, str, tuple[int, ...] | None]]
        if self._checked:
            feeds, fetch = self._plan[0], list(self._plan[1])
        else:  # called directly, not through a runtime: ONNX names, ONNX shapes
            feeds = [(n, n, _numpy_type(self._onnx_inputs[n])) for n in inputs]
            fetch = [(n, n, None) for n in self._onnx_outputs]
        feed = {}
        for dla_name, onnx_name, dtype in feeds:
            arg = self._onnx_inputs[onnx_name]
            array = inputs[dla_name].astype(dtype, copy=False)
            rank = len(arg.shape)
            feed[onnx_name] = array.reshape(array.shape[:rank]) if rank < 4 else array
        results = self._session.run([onnx for _, onnx, _ in fetch], feed)
        outputs: dict[str, Any] = {}
        for (dla_name, onnx_name, shape), result in zip(fetch, results, strict=True):
            if shape is not None and np.size(result) != int(np.prod(shape)):
                # (an output whose shape no free dimension fixed: known only now)
                raise ModelError(
                    f"onnx_compute({self.source!r}): ONNX output {onnx_name!r} came out "
                    f"{list(np.shape(result))}, which does not fit the model's {shape}"
                )
            outputs[dla_name] = result if shape is None else np.reshape(result, shape)
        return outputs


def _refuse_external_data(source: Any) -> None:
    """ModelError when the network (bytes) keeps any weights in external files."""
    try:
        import onnx
        from onnx.external_data_helper import uses_external_data
    except ImportError as exc:
        raise ConfigurationError(
            "a loadable's own ONNX network is checked with onnx: pip install 'aiodla[onnx]'"
        ) from exc
    try:
        model = (
            onnx.load_from_string(source)
            if isinstance(source, bytes)
            else onnx.load(source, load_external_data=False)
        )
    except Exception as exc:
        raise ModelError(f"the ONNX network is not a readable model: {exc}") from exc
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        tensors.extend(a.t for a in node.attribute if a.HasField("t"))
    for tensor in tensors:
        if uses_external_data(tensor):
            raise ModelError(
                f"the ONNX network keeps tensor {tensor.name!r} in an external file; a "
                "loadable's network must hold its weights"
            )


def _numpy_type(arg: Any) -> Any:
    dtype = _ONNX_TYPES.get(arg.type)
    if dtype is None:
        raise ModelError(f"ONNX tensor {arg.name!r} has type {arg.type}, which no DLA tensor has")
    return dtype
