"""TensorSpec (aiodla._tensors): construction errors and the validation of user arrays
that the engine runs before anything is queued."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from aiodla import EmulatedRuntime, Engine
from aiodla._descriptors import DataCategory
from aiodla._errors import ConfigurationError, InputTypeError, InputValueError, ModelError
from aiodla._tensors import TensorSpec

from support import X, affine_model
from tensor_reference import MODES, in_mode


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
        assert (spec.dtype, spec.format, spec.describe()) == (
            "float16",
            "chw16",
            "x: 1x3x2x2 float16 chw16",
        )


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


# -- no silent loss of values ------------------------------------------------------------

F16 = TensorSpec("x", (1, 3, 4, 5), "float16", "chw16")


def beyond_message(
    value: str, index: tuple[int, ...], dtype: str, tensor: str = "float16", largest: str = "65504"
) -> str:
    return (
        rf"^input 'x': value {value} at index {re.escape(str(index))} does not fit {tensor} "
        rf"\(largest {re.escape(largest)}\); {dtype} arrays are taken only when"
    )


class TestNoSilentLoss:
    def test_float64_beyond_float16_is_refused_naming_tensor_value_and_index(self) -> None:
        wide = np.zeros(F16.shape, np.float64)
        wide[0, 0, 1, 2] = 1e6
        with pytest.raises(
            InputValueError, match=beyond_message(r"1000000\.0", (0, 0, 1, 2), "float64")
        ):
            F16.check_array(wide)
        with pytest.raises(
            InputValueError, match=beyond_message(r"1000000\.0", (0, 0, 1, 2), "float64")
        ):
            F16.pack(wide)
        wide[0, 0, 1, 2] = -65504.5  # would round to -65504, but lies beyond the largest
        with pytest.raises(
            InputValueError, match=beyond_message(r"-65504\.5", (0, 0, 1, 2), "float64")
        ):
            F16.check_array(wide)

    @pytest.mark.parametrize("mode", MODES)
    def test_the_first_value_beyond_in_c_order_with_its_index(self, mode: str) -> None:
        spec = TensorSpec("x", (2, 3, 256, 256), "float16", "nchw")  # many blocks
        wide = np.zeros(spec.shape, np.float32, order="F")
        wide[1, 0, 255, 255] = np.nan  # passes, and hides nothing
        wide[1, 2, 200, 17] = 70000.0
        wide[1, 2, 201, 3] = -1e30  # later in C order, earlier in memory (Fortran)
        with (
            in_mode(mode),
            pytest.raises(
                InputValueError, match=beyond_message(r"70000\.0", (1, 2, 200, 17), "float32")
            ),
        ):
            spec.check_array(wide)

    def test_float64_within_range_is_taken_and_stored_as_the_float32_path_stores_it(self) -> None:
        rng = np.random.default_rng(11)
        narrow = (rng.standard_normal(F16.shape) * 3000).astype(np.float32)
        narrow[0, 0, 0, :4] = [65504.0, -65504.0, 1e-8, -0.0]
        narrow[0, 1, 0, :3] = [np.nan, np.inf, -np.inf]  # already NaN or infinite: kept
        wide = narrow.astype(np.float64)
        assert F16.check_array(wide) is wide
        assert F16.check_array(narrow) is narrow
        assert F16.pack(wide).tobytes() == F16.pack(narrow).tobytes()
        f32 = TensorSpec("y", (1, 3, 4, 5), "float32", "nchw")
        assert f32.pack(wide).tobytes() == f32.pack(narrow).tobytes()

    def test_float64_beyond_float32_is_refused(self) -> None:
        spec = TensorSpec("x", (1, 3, 4, 5), "float32", "nchw")
        wide = np.ones(spec.shape, np.float64)
        wide[0, 2, 3, 4] = -1e39
        with pytest.raises(
            InputValueError,
            match=beyond_message(r"-1e\+39", (0, 2, 3, 4), "float64", "float32", "3.4028235e+38"),
        ):
            spec.check_array(wide)

    def test_integers_beyond_float16_are_refused(self) -> None:
        for dtype in (np.int64, np.int32, np.uint16, np.uint64):
            array = np.full(F16.shape, 65504, dtype)
            assert F16.check_array(array) is array
            assert F16.pack(array).tobytes() == F16.pack(array.astype(np.float32)).tobytes()
            array[0, 1, 3, 0] = 65505
            with pytest.raises(
                InputValueError, match=beyond_message("65505", (0, 1, 3, 0), np.dtype(dtype).name)
            ):
                F16.check_array(array)
        extreme = np.full(F16.shape, np.iinfo(np.int16).min, np.int16)  # every int16 fits
        assert F16.check_array(extreme) is extreme

    def test_integer_tensors_keep_their_rules(self) -> None:
        spec = TensorSpec("q", (1, 3, 2, 2), "int8", "chw32", scale=0.5)
        wide = np.full(spec.shape, 1e30)  # quantized and saturated, as for float32
        assert spec.check_array(wide) is wide
        assert (spec.unpack(spec.pack(wide), dequantize=False) == 127).all()

    def test_same_kind_casting_is_numpys_rule(self) -> None:
        wide = np.zeros(F16.shape, np.float64)
        wide[0, 0, 1, 2] = 1e6
        assert F16.check_array(wide, casting="same_kind") is wide
        assert F16.unpack(F16.pack(wide, validate=False))[0, 0, 1, 2] == np.inf
        with pytest.raises(ConfigurationError, match="casting='unsafe' must be"):
            F16.check_array(wide, casting="unsafe")  # type: ignore[arg-type]

    def test_masked_arrays_are_refused(self) -> None:
        masked = np.ma.masked_array(np.zeros(F16.shape, np.float16), mask=False)
        with pytest.raises(InputTypeError, match=r"mask would be ignored.*\.filled\("):
            F16.check_array(masked)
        with pytest.raises(InputTypeError, match="mask would be ignored"):
            F16.pack(masked)


class TestTheEngineRefusesBeforeQueueing:
    @pytest.mark.asyncio
    async def test_values_beyond_range_and_masked_arrays(self, engine: Engine) -> None:
        submitted = engine.statistics().submitted
        wide = np.zeros(X.shape, np.float64)
        wide[0, 1, 2, 3] = 1e6
        refused = beyond_message(r"1000000\.0", (0, 1, 2, 3), "float64")
        with pytest.raises(InputValueError, match=refused):
            await engine.infer(wide)
        with pytest.raises(InputValueError, match=refused):
            await engine.infer({"x": wide})
        with pytest.raises(InputValueError, match=refused):
            engine.check_inputs(wide)
        integers = np.zeros(X.shape, np.int64)
        integers[0, 2, 7, 7] = -70000
        with pytest.raises(InputValueError, match=beyond_message("-70000", (0, 2, 7, 7), "int64")):
            await engine.infer(integers)
        with pytest.raises(InputTypeError, match="mask would be ignored"):
            await engine.infer(np.ma.masked_array(np.zeros(X.shape, np.float16)))
        assert engine.statistics().submitted == submitted
        narrow = np.random.default_rng(12).uniform(-100, 100, X.shape).astype(np.float32)
        same = await engine.infer(narrow.astype(np.float64))
        assert same.tobytes() == (await engine.infer(narrow)).tobytes()
        assert engine.statistics().submitted == submitted + 2

    @pytest.mark.asyncio
    async def test_the_engine_option_same_kind_takes_numpys_rule(
        self, runtime: EmulatedRuntime
    ) -> None:
        wide = np.zeros(X.shape, np.float64)
        wide[0, 1, 2, 3] = 1e6
        async with Engine(affine_model(), runtime=runtime, casting="same_kind") as engine:
            y = await engine.infer(wide)
        assert np.isinf(y[0, 1, 2, 3]) and np.count_nonzero(np.isinf(y)) == 1
        with pytest.raises(ConfigurationError, match="casting='unsafe'"):
            Engine(affine_model(), runtime=runtime, casting="unsafe")
