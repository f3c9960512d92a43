"""The user's own computation in the emulated runtime (``compute=``).

An emulator loadable gives a model's tensors and its service time; its op computes
stand-in numbers. A *compute function* computes the real ones instead: it takes the
logical input arrays by name, as the device would see them (after the round trip
through the DLA layout: FP16 rounding, INT8 as the stored integers, since the DLA
knows no scales), and returns the logical outputs by name. The emulated runtime calls
it on a thread of its own, never the event loop's (see ``ComputeWorker``); the task
still lasts the loadable's service time.

What it returns is checked against the output specs: every output name once, no other
name, each array of the output's shape and of a dtype numpy casts to the output's type
within its kind (``same_kind``: float32 into an FP16 output is rounded as the device
rounds). A mismatch, or an exception raised by the function, fails that request with
:class:`aiodla.ComputeError` naming the function and what went wrong (the exception as
its ``__cause__``); the engine goes on serving, and the DLA core is not blamed.

A loadable may name its compute function (``module:function``, ``aiodla emulate
--compute``); the runtime imports it only when the user trusts the file
(``trust_compute=True``, ``--trust-compute``), since importing a module runs its code.

A compute function may also have a ``check(inputs, outputs)`` method, taking the
model's TensorSpecs: the runtime calls it when it loads the module, so a mismatch
between the function and the model fails the engine's open (``onnx_compute`` and
``replay`` check names and shapes there).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import ComputeError, InputError, ModelError
from .._layout import BoundTensor
from .._tensors import TensorSpec
from ._format import is_compute_reference

__all__ = ["ComputeFunction", "ComputeTask", "check_compute", "describe", "import_compute"]

ComputeFunction = Callable[[Mapping[str, np.ndarray[Any, Any]]], Mapping[str, Any]]
"""``compute(inputs) -> outputs``: logical arrays by tensor name, both ways."""


def describe(function: Any) -> str:
    """How error messages name a compute function: ``module:qualname`` for a function,
    its repr for any other callable (``onnx_compute('model.onnx')``, say)."""
    if not inspect.isroutine(function):
        return repr(function)
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None)
    if isinstance(module, str) and isinstance(name, str):
        return f"{module}:{name}"
    return repr(function)


def import_compute(reference: str) -> ComputeFunction:
    """The callable named by a compute reference ``"module:function"``."""
    if not isinstance(reference, str) or not is_compute_reference(reference):
        raise ModelError(f"compute reference {reference!r} is not 'module:function'")
    module_name, _, attribute = reference.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(
            f"compute reference {reference!r}: cannot import {module_name!r} ({exc})"
        ) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ModelError(
                f"compute reference {reference!r}: {module_name!r} has no {attribute!r}"
            ) from None
    if not callable(target):
        raise ModelError(f"compute reference {reference!r} names a {type(target).__name__}")
    return target  # type: ignore[no-any-return]


def check_compute(
    function: Any, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> None:
    """At load: ``function`` is callable, and its own ``check`` accepts the model."""
    if not callable(function):
        raise ModelError(f"compute={function!r} is not callable")
    check = getattr(function, "check", None)
    if callable(check):
        check(tuple(inputs), tuple(outputs))


class ComputeTask:
    """One task's buffers bound to a compute function.

    :meth:`compute` reads the inputs from the device buffers, calls the function and
    checks what it returned: the output arrays, or the :class:`ComputeError` of a
    failure. :meth:`write` stores the arrays in the output buffers; the runtime calls it
    only while the task still wants them (a task ended by its timeout does not).
    """

    def __init__(
        self,
        function: ComputeFunction,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        input_buffers: Sequence[Any],
        output_buffers: Sequence[Any],
    ) -> None:
        self.function = function
        self._inputs = [
            BoundTensor(spec, buffer, zero=False)
            for spec, buffer in zip(inputs, input_buffers, strict=True)
        ]
        self._outputs = [
            BoundTensor(spec, buffer, zero=False)
            for spec, buffer in zip(outputs, output_buffers, strict=True)
        ]

    def compute(self) -> list[np.ndarray[Any, Any]] | ComputeError:
        name = describe(self.function)
        arrays = {bound.spec.name: bound.read() for bound in self._inputs}
        try:
            result = self.function(arrays)
        except ComputeError as exc:  # it says itself what went wrong (replay does)
            return exc
        # BaseException too: SystemExit or KeyboardInterrupt raised by the function
        # ends its task like any failure; on the runtime's thread nothing else would.
        except BaseException as exc:
            error = ComputeError(f"compute function {name} raised {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            return error
        try:
            return check_outputs(name, result, [b.spec for b in self._outputs])
        except ComputeError as exc:
            return exc

    def write(self, checked: Sequence[np.ndarray[Any, Any]]) -> None:
        for bound, array in zip(self._outputs, checked, strict=True):
            if not bound.spec._is_dense():
                bound.raw[:] = 0  # every byte of an output is written, padding as zeros
            bound.write(array, checked=True)


def check_outputs(
    name: str, result: Any, specs: Sequence[TensorSpec]
) -> list[np.ndarray[Any, Any]]:
    """The arrays of ``result``, in the order of ``specs``, or a ComputeError saying
    how ``result`` does not fit them."""
    if not isinstance(result, Mapping):
        raise ComputeError(
            f"compute function {name} returned {type(result).__name__}; it must return "
            "a mapping of output name to array"
        )
    wanted = [spec.name for spec in specs]
    missing = [n for n in wanted if n not in result]
    extra = sorted(repr(n) for n in result if n not in wanted)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"no {', '.join(map(repr, missing))}")
        if extra:
            parts.append(f"unknown {', '.join(extra)}")
        raise ComputeError(
            f"compute function {name} returned outputs {sorted(map(str, result))}: "
            f"{'; '.join(parts)} (the model's outputs are {wanted})"
        )
    arrays = []
    for spec in specs:
        value = result[spec.name]
        array = value if isinstance(value, np.ndarray) else np.asarray(value)
        what = f"compute function {name} returned output {spec.name!r}"
        if array.shape != spec.shape:
            raise ComputeError(
                f"{what} of shape {array.shape}; the model's is {spec.shape} (n, c, h, w)"
            )
        target = spec.result_dtype
        if array.dtype.kind not in "biuf" or not np.can_cast(array.dtype, target, "same_kind"):
            raise ComputeError(
                f"{what} of dtype {array.dtype}, which does not cast to the output's "
                f"{target} (numpy's same_kind rule)"
            )
        try:
            arrays.append(spec.check_array(array, casting="same_kind"))
        except InputError as exc:
            raise ComputeError(f"{what} that the output cannot store: {exc}") from None
    return arrays
