"""TensorSpec (aiodla._tensors): construction errors and the validation of user arrays
that the engine runs before anything is queued."""

from __future__ import annotations

import math

import numpy as np
import pytest

from aiodla._descriptors import DataCategory
from aiodla._errors import InputTypeError, InputValueError, ModelError
from aiodla._tensors import TensorSpec


class TestSpec:
    def test_spec_errors(self) -> None:
        with pytest.raises(ModelError, match="hwc4 is the IMAGE category"):
            TensorSpec("x", (1, 3, 2, 2), "uint8", "hwc4", category=int(DataCategory.FEATURE))
        with pytest.raises(ModelError, match="is the hwc4 image input"):
            TensorSpec("x", (1, 3, 2, 2), "uint8", "nhwc", strides=(4, 8, 16, 16), category=0)
        with pytest.raises(ModelError, match="integer tensors only"):
            TensorSpec("x", (1, 3, 2, 2), "float16", "chw16", scale=0.5)
        for bad in (0.0, -1.0, math.inf, math.nan, "x"):
            with pytest.raises(ModelError, match="scale must be a finite number > 0"):
                TensorSpec("x", (1, 3, 2, 2), "int8", "chw32", scale=bad)  # type: ignore[arg-type]
        with pytest.raises(ModelError, match="strides must be four byte counts"):
            TensorSpec("x", (1, 3, 2, 2), "int8", "chw32", strides=(32, 64, 128))  # type: ignore[arg-type]
        with pytest.raises(ModelError, match="dtype 'float64' is not a DLA element type"):
            TensorSpec("x", (1, 3, 2, 2), "float64", "nchw")
        with pytest.raises(ModelError, match="format 'chw8' is unknown"):
            TensorSpec("x", (1, 3, 2, 2), "float16", "chw8")
        with pytest.raises(ModelError, match=r"shape must be \(n, c, h, w\)"):
            TensorSpec("x", "abc", "float16", "nchw")  # type: ignore[arg-type]
        with pytest.raises(ModelError, match="nbytes must be a byte count"):
            TensorSpec("x", (1, 3, 2, 2), "float16", "nchw", nbytes="many")  # type: ignore[arg-type]
        spec = TensorSpec("x", (1, 3, 2, 2), np.float16, "CHW16")
        assert (spec.dtype, spec.format, spec.describe()) == ("float16", "chw16", "x: 1x3x2x2 float16 chw16")


# -- validating user arrays ---------------------------------------------------------------


class TestCheckArray:
    def test_nan_into_integer_tensors_is_an_input_error(self) -> None:
        spec = TensorSpec("q", (1, 3, 2, 2), "int8", "chw32", scale=0.5)
        array = np.zeros(spec.shape, np.float32)
        array[0, 2, 1, 1] = np.nan
        with pytest.raises(InputValueError, match="NaN"):
            spec.check_array(array)
        with pytest.raises(InputValueError, match="NaN"):
            spec.pack(array)
        with pytest.raises(InputValueError, match="NaN"):
            spec.pack(array, validate=False)
        with pytest.raises(InputValueError, match="NaN"):
            spec.quantize(array)
        bound = spec.bind(np.zeros(spec.size, np.uint8))
        with pytest.raises(InputValueError, match="NaN"):
            bound.write(array)
        assert not bound.raw.any()  # refused before anything was stored


    def test_float_array_without_a_scale_is_an_input_error(self) -> None:
        spec = TensorSpec("q", (1, 3, 2, 2), "int8", "nchw")
        with pytest.raises(InputTypeError, match="needs a quantization scale"):
            spec.check_array(np.zeros(spec.shape, np.float32))
        with pytest.raises(InputTypeError, match="needs a quantization scale"):
            spec.bind(np.zeros(spec.size, np.uint8)).write(np.zeros(spec.shape, np.float32))
        with pytest.raises(InputTypeError, match="integer tensor with a scale"):
            spec.quantize(np.zeros(spec.shape))

    def test_unsafe_integer_casts_are_refused(self) -> None:
        spec = TensorSpec("q", (1, 3, 2, 2), "int8", "nchw", scale=1.0)
        for dtype in (np.uint8, np.int16, np.int64):
            with pytest.raises(InputTypeError, match="cannot be cast safely"):
                spec.check_array(np.zeros(spec.shape, dtype))
            with pytest.raises(InputTypeError, match="cannot be cast safely"):
                spec.bind(np.zeros(spec.size, np.uint8)).write(np.zeros(spec.shape, dtype))

    def test_check_array_errors(self) -> None:
        spec = TensorSpec("x", (1, 3, 2, 2), "float16", "chw16")
        with pytest.raises(InputValueError, match="expected shape"):
            spec.check_array(np.zeros((1, 3, 2, 3), np.float32))
        with pytest.raises(InputTypeError, match="numeric"):
            spec.check_array(np.zeros(spec.shape, np.complex64))
        with pytest.raises(InputTypeError, match="cannot be converted"):
            spec.check_array("not an array")
        assert spec.check_array([[[[0.0, 1.0]] * 2] * 3]).shape == spec.shape
        with pytest.raises(InputValueError, match="expected shape"):
            spec.bind(np.zeros(spec.size, np.uint8)).write(np.zeros((1, 3, 2, 1), np.float16))
