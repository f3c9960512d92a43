"""ImagePreprocess (aiodla._preprocess): configuration, geometry, frame validation, the
arithmetic of the module docstring bit for bit, and OpenCV as the reference.

The OpenCV comparisons take the ``cv2`` fixture and skip where opencv-python-headless
is not installed; everything else runs without it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from aiodla._errors import ConfigurationError, InputTypeError, InputValueError
from aiodla._preprocess import Geometry, ImagePreprocess
from aiodla._tensors import TensorSpec

SOURCES = ("bgr", "rgb", "bgra", "rgba", "nv12", "i420")
PLANAR = ("nv12", "i420")
PACKED = {"bgr": 3, "rgb": 3, "bgra": 4, "rgba": 4}
RGB_AT = {"bgr": (2, 1, 0), "rgb": (0, 1, 2), "bgra": (2, 1, 0), "rgba": (0, 1, 2)}
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
f32 = np.float32


@pytest.fixture(scope="module")
def cv2() -> Any:
    # exc_type: a cv2 that is installed but cannot load (libGL missing, say) skips too
    return pytest.importorskip("cv2", exc_type=ImportError)


def spec(height: int, width: int, **kwargs: Any) -> TensorSpec:
    return TensorSpec("images", (1, 3, height, width), "float16", "chw16", **kwargs)


def frame(source: str, height: int, width: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """Random bytes: the worst case for interpolation (neighbours differ by up to 255)."""
    rng = np.random.default_rng(seed)
    shape = (height * 3 // 2, width) if source in PLANAR else (height, width, PACKED[source])
    return rng.integers(0, 256, shape, dtype=np.uint8)


def definition(pre: ImagePreprocess, image: np.ndarray[Any, Any], height: int, width: int) -> Any:
    """The module docstring's arithmetic, pixel by pixel with numpy float32 scalars (each
    operation rounded to float32) and Python ints: an implementation apart from the
    vectorized one."""
    if pre.source in PLANAR:
        rows, columns = image.shape[0] * 2 // 3, image.shape[1]
    else:
        rows, columns = image.shape[:2]

    def rgb(y: int, x: int) -> tuple[int, int, int]:
        if pre.source not in PLANAR:
            pixel = image[y, x]
            return tuple(int(pixel[i]) for i in RGB_AT[pre.source])  # type: ignore[return-value]
        luma = int(image[y, x])
        if pre.source == "nv12":
            u = int(image[rows + y // 2, x // 2 * 2]) - 128
            v = int(image[rows + y // 2, x // 2 * 2 + 1]) - 128
        else:  # i420: chroma row r of columns/2 bytes, two to an array row
            ru, rv = y // 2, rows // 2 + y // 2
            u = int(image[rows + ru // 2, ru % 2 * (columns // 2) + x // 2]) - 128
            v = int(image[rows + rv // 2, rv % 2 * (columns // 2) + x // 2]) - 128
        c = max(luma - 16, 0) * 1220542 + 2**19
        levels = (c + 1673527 * v, c - 852492 * v - 409993 * u, c + 2116026 * u)
        return tuple(min(max(level >> 20, 0), 255) for level in levels)  # type: ignore[return-value]

    def table(m: int, n: int) -> list[tuple[int, int, np.float32]]:
        entries = []
        for d in range(n):
            src = (d + 0.5) * (m / n) - 0.5
            i = math.floor(src)
            t = src - i
            if i < 0:
                i, t = 0, 0.0
            if i >= m - 1:
                i, t = m - 1, 0.0
            entries.append((i, min(i + 1, m - 1), f32(t)))
        return entries

    if pre.resize == "letterbox":
        s = min(height / rows, width / columns)
        h, w = round(rows * s), round(columns * s)
        top, left = (height - h) // 2, (width - w) // 2
    else:
        h, w, top, left = height, width, 0, 0
    ys, xs = table(rows, h), table(columns, w)
    lanes = (0, 1, 2) if pre.order == "rgb" else (2, 1, 0)
    mean, std = pre.mean, pre.std
    assert isinstance(mean, tuple) and isinstance(std, tuple)
    out = np.empty((1, 3, height, width), f32)
    for oy in range(height):
        for ox in range(width):
            if top <= oy < top + h and left <= ox < left + w:
                y0, y1, fy = ys[oy - top]
                x0, x1, fx = xs[ox - left]
                a, b, c, d = (rgb(y, x) for y, x in ((y0, x0), (y0, x1), (y1, x0), (y1, x1)))
            for k, lane in enumerate(lanes):
                if top <= oy < top + h and left <= ox < left + w:
                    upper = f32(a[lane]) + fx * (f32(b[lane]) - f32(a[lane]))
                    lower = f32(c[lane]) + fx * (f32(d[lane]) - f32(c[lane]))
                    value = upper + fy * (lower - upper)
                else:
                    value = f32(pre.pad_value)
                out[0, k, oy, ox] = (value * f32(pre.scale) - f32(mean[k])) / f32(std[k])
    return out


CASES = [
    ((1080, 1920), (640, 640)),  # 3x down, letterbox
    ((720, 1280), (384, 640)),
    ((480, 640), (321, 257)),  # odd model sizes
    ((38, 54), (64, 48)),  # upscaling, odd-ish frame
    ((120, 160), (640, 640)),  # 4x up
    ((200, 300), (100, 150)),  # exactly 2x down: OpenCV switches to INTER_AREA
    ((64, 96), (64, 96)),
]


class TestConfiguration:
    def test_normalized(self) -> None:
        pre = ImagePreprocess(source="nv12", order="bgr", resize=None, mean=0.5, std=[1, 2, 4])
        assert pre.mean == (0.5, 0.5, 0.5) and pre.std == (1.0, 2.0, 4.0)
        assert pre.pad_value == 114 and pre.scale == 1 / 255 and pre.max_frame == (1080, 1920)
        assert hash(pre) == hash(dataclass_copy(pre))
        assert pre == dataclass_copy(pre)
        with pytest.raises(AttributeError):
            pre.order = "rgb"  # type: ignore[misc]
        assert "_constants" not in repr(pre)

    @pytest.mark.parametrize(
        ("keywords", "match"),
        [
            ({"source": "yuyv"}, "source='yuyv' must be"),
            ({"source": None}, "source=None must be"),
            ({"order": "rgba"}, "order='rgba' must be 'rgb' or 'bgr'"),
            ({"resize": "crop"}, "resize='crop' must be"),
            ({"pad_value": 256}, "pad_value=256 must be an integer level 0..255"),
            ({"pad_value": -1}, "pad_value=-1 must be"),
            ({"pad_value": 1.5}, "pad_value=1.5 must be"),
            ({"pad_value": True}, "pad_value=True must be"),
            ({"pad_value": "114"}, "pad_value='114' must be"),
            ({"scale": 0}, "scale=0 must be a finite number > 0"),
            ({"scale": -1.0}, "scale=-1.0 must be"),
            ({"scale": math.inf}, "scale=inf must be"),
            ({"scale": math.nan}, "scale=nan must be"),
            ({"scale": "1"}, "scale='1' must be"),
            ({"mean": (1, 2)}, r"mean=\(1, 2\) must be a number or 3 numbers"),
            ({"mean": "abc"}, "mean='abc' must be a number or 3 numbers"),
            ({"mean": (1, 2, None)}, r"mean=\(1, 2, None\) must be a number or 3"),
            ({"mean": math.nan}, "mean=nan must be finite"),
            ({"std": 0}, "std=0 must be finite and > 0"),
            ({"std": (1, -1, 1)}, r"std=\(1, -1, 1\) must be finite and > 0"),
            ({"std": (1, 1, math.inf)}, "must be finite and > 0"),
            ({"std": {1, 2, 3}}, "std={1, 2, 3} must be a number or 3 numbers"),
            # finite as float64, 0 or inf as the float32 normalization computes
            ({"std": 1e-300}, "std=1e-300 is 0.0 as a float32 .* must be finite and > 0"),
            ({"std": (1, 1, 1e39)}, "std=1e[+]?39 is inf as a float32"),
            ({"scale": 1e300}, "scale=1e[+]?300 is inf as a float32 .* must be a finite"),
            ({"scale": 1e-300}, "scale=1e-300 is 0.0 as a float32"),
            ({"mean": (0, 1e39, 0)}, "mean=1e[+]?39 is inf as a float32 .* must be finite"),
            ({"std": 1e-38, "scale": 1.0}, "normalize level 255 to inf in float32"),
            ({"mean": -3e38, "std": 0.5}, "normalize level 0 to inf in float32"),
            ({"max_frame": (0, 10)}, r"max_frame=\(0, 10\) must be \(height, width\)"),
            ({"max_frame": (10, 16385)}, r"max_frame=\(10, 16385\) must be"),
            ({"max_frame": 1080}, "max_frame=1080 must be"),
            ({"max_frame": (1080.0, 1920)}, r"max_frame=\(1080.0, 1920\) must be"),
            ({"max_frame": (1080, 1920, 3)}, r"max_frame=\(1080, 1920, 3\) must be"),
            ({"color_range": "pc"}, "color_range='pc' must be 'limited' or 'full'"),
            ({"color_range": "full"}, "color_range='full' is for YUV frames .* bgr frames"),
        ],
    )
    def test_bad_keyword(self, keywords: dict[str, Any], match: str) -> None:
        base: dict[str, Any] = {"source": "bgr", "order": "rgb", "resize": "letterbox"}
        with pytest.raises(ConfigurationError, match=match):
            ImagePreprocess(**{**base, **keywords})

    def test_keywords_only(self) -> None:
        with pytest.raises(TypeError):
            ImagePreprocess("bgr", "rgb", "letterbox")  # type: ignore[call-arg]

    def test_max_frame_nbytes(self) -> None:
        assert ImagePreprocess(source="bgr", order="rgb", resize=None).max_frame_nbytes == (
            1080 * 1920 * 3
        )
        bgra = ImagePreprocess(source="bgra", order="rgb", resize=None, max_frame=(7, 9))
        assert bgra.max_frame_nbytes == 7 * 9 * 4
        for source in PLANAR:
            planar = ImagePreprocess(source=source, order="rgb", resize=None, max_frame=(7, 9))
            assert planar.max_frame_nbytes == 6 * 8 * 3 // 2  # the largest even frame


def dataclass_copy(pre: ImagePreprocess) -> ImagePreprocess:
    return ImagePreprocess(
        source=pre.source, order=pre.order, resize=pre.resize, mean=pre.mean, std=pre.std
    )


class TestGeometry:
    def test_letterbox(self) -> None:
        pre = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
        assert pre.geometry(1080, 1920, 640, 640) == Geometry(1 / 3, 140, 0, 1 / 3, 1 / 3)
        scale, top, left = pre.geometry(1080, 1920, 640, 640)  # the spelling
        assert (scale, top, left) == (1 / 3, 140, 0)
        # s = min(64/37, 48/53) = 48/53; 37 * s = 33.51 rounds to 34; top = 30 // 2
        g = pre.geometry(37, 53, 64, 48)
        assert (g.scale, g.top, g.left) == (48 / 53, 15, 0)
        assert (g.scale_y, g.scale_x) == (34 / 37, 1.0 * 48 / 53)
        # portrait frame, odd difference: left = (640 - 213) // 2
        g = pre.geometry(960, 320, 640, 640)
        assert (g.scale, g.top, g.left, g.scale_x) == (2 / 3, 0, 213, 213 / 320)
        # a sliver keeps at least one row
        assert pre.geometry(1, 10000, 640, 640) == Geometry(0.064, 319, 0, 1.0, 0.064)

    def test_stretch(self) -> None:
        pre = ImagePreprocess(source="bgr", order="rgb", resize="stretch")
        g = pre.geometry(1080, 1920, 640, 640)
        assert math.isnan(g.scale)
        assert (g.top, g.left, g.scale_y, g.scale_x) == (0, 0, 640 / 1080, 640 / 1920)

    def test_none(self) -> None:
        pre = ImagePreprocess(source="bgr", order="rgb", resize=None)
        assert pre.geometry(64, 48, 64, 48) == Geometry(1.0, 0, 0, 1.0, 1.0)
        with pytest.raises(InputValueError, match="resize=None takes frames of the model's size"):
            pre.geometry(64, 50, 64, 48)

    @pytest.mark.parametrize(
        ("size", "error", "match"),
        [
            (0, InputValueError, "size 0 is not within 1..16384"),
            (16385, InputValueError, "size 16385 is not within"),
            (1.5, InputTypeError, "integer sizes, got 1.5"),
            (True, InputTypeError, "integer sizes, got True"),
            ("3", InputTypeError, "integer sizes, got '3'"),
        ],
    )
    def test_bad_size(self, size: Any, error: type[Exception], match: str) -> None:
        pre = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
        with pytest.raises(error, match=match):
            pre.geometry(size, 10, 10, 10)
        with pytest.raises(error, match=match):
            pre.geometry(10, 10, 10, size)

    def test_numpy_integers(self) -> None:
        pre = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
        assert pre.geometry(np.int64(1080), np.int32(1920), 640, 640).top == 140

    def test_to_frame(self) -> None:
        g = Geometry(0.5, 10, 20, 0.5, 0.25)
        boxes = g.to_frame([[20, 10, 30, 20], [0, 0, 20, 10]])
        assert boxes.tolist() == [[0, 0, 40, 20], [-80, -20, 0, 0]]
        assert g.to_frame(np.zeros((2, 3, 4))).shape == (2, 3, 4)
        with pytest.raises(InputValueError, match=r"boxes must have shape \(..., 4\)"):
            g.to_frame([1, 2, 3])

    @pytest.mark.parametrize("resize", ["letterbox", "stretch"])
    @pytest.mark.parametrize(
        ("frame_size", "model_size", "box"),
        [
            ((1080, 1920), (640, 640), (300, 500, 700, 900)),  # y1, x1, y2, x2
            ((480, 640), (640, 640), (100, 37, 301, 250)),
            ((37, 53), (64, 48), (5, 9, 30, 40)),
            ((96, 64), (64, 96), (10, 20, 60, 50)),
        ],
    )
    def test_box_round_trip(
        self,
        resize: str,
        frame_size: tuple[int, int],
        model_size: tuple[int, int],
        box: tuple[int, int, int, int],
    ) -> None:
        """A filled rectangle on the frame lands where the geometry maps it: every model
        pixel whose centre is more than one frame pixel inside the mapped box is the box
        exactly, every one more than one frame pixel outside it is not touched by it."""
        pre = ImagePreprocess(source="bgr", order="rgb", resize=resize, scale=1.0, pad_value=7)  # type: ignore[arg-type]
        image = np.full((*frame_size, 3), 50, np.uint8)
        y1, x1, y2, x2 = box
        image[y1:y2, x1:x2] = 200
        g = pre.geometry(*frame_size, *model_size)
        out = pre.apply(image, spec(*model_size))[0, 0]
        top, left = g.top + y1 * g.scale_y, g.left + x1 * g.scale_x
        bottom, right = g.top + y2 * g.scale_y, g.left + x2 * g.scale_x
        assert np.allclose(g.to_frame([left, top, right, bottom]), [x1, y1, x2, y2])
        cy = np.arange(model_size[0])[:, None] + 0.5
        cx = np.arange(model_size[1])[None, :] + 0.5
        inside = (top + g.scale_y <= cy) & (cy <= bottom - g.scale_y)
        inside = inside & (left + g.scale_x <= cx) & (cx <= right - g.scale_x)
        outside = (cy <= top - g.scale_y) | (cy >= bottom + g.scale_y)
        outside = outside | (cx <= left - g.scale_x) | (cx >= right + g.scale_x)
        assert inside.sum() > 0.5 * (bottom - top) * (right - left)
        assert (out[inside] == 200).all()
        assert np.isin(out[outside], (50, 7)).all()
        content = np.zeros(model_size, bool)
        content[g.top : g.top + round(frame_size[0] * g.scale_y)] = True
        content[:, : g.left] = content[:, g.left + round(frame_size[1] * g.scale_x) :] = False
        assert (out[~content] == 7).all() and not (out[content] == 7).any()


class TestValidation:
    def test_check_target(self) -> None:
        pre = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
        pre.check_target(spec(640, 640))
        pre.check_target(TensorSpec("images", (1, 3, 8, 8), "int8", "chw32", scale=0.02))
        with pytest.raises(ConfigurationError, match=r"input 'images' .* 3 channels .* has 4"):
            pre.check_target(TensorSpec("images", (1, 4, 8, 8), "float16", "chw16"))
        with pytest.raises(ConfigurationError, match=r"input 'images' .* has 1"):
            pre.check_target(TensorSpec("images", (1, 1, 8, 8), "float16", "nchw"))
        with pytest.raises(ConfigurationError, match=r"input 'images' .* one image, n is 2"):
            pre.check_target(TensorSpec("images", (2, 3, 8, 8), "float16", "chw16"))
        with pytest.raises(ConfigurationError, match=r"input 'images' .* quantization scale"):
            pre.check_target(TensorSpec("images", (1, 3, 8, 8), "int8", "chw32"))
        small = ImagePreprocess(source="bgr", order="rgb", resize=None, max_frame=(480, 640))
        small.check_target(spec(480, 640))
        with pytest.raises(ConfigurationError, match=r"input 'images' .* 481x640, larger than"):
            small.check_target(spec(481, 640))
        # a resizing preprocess takes any model size: frames are resized to it
        ImagePreprocess(source="bgr", order="rgb", resize="stretch", max_frame=(4, 4)).check_target(
            spec(640, 640)
        )

    @pytest.mark.parametrize(
        ("source", "resize", "value", "error", "match"),
        [
            ("bgr", "stretch", np.zeros((4, 4, 3), np.float32), InputTypeError, "must be uint8, got float32"),
            ("bgr", "stretch", np.zeros((4, 4, 3), np.int16), InputTypeError, "uint8, got int16"),
            ("bgr", "stretch", [[[1, 2, 3]]], InputTypeError, "uint8, got int64"),
            ("bgr", "stretch", "frame", InputTypeError, "uint8, got <U5"),
            ("bgr", "stretch", [[1, 2], [3]], InputTypeError, "expected a uint8 bgr frame, got list"),
            ("bgr", "stretch", np.ma.zeros((4, 4, 3), np.uint8), InputTypeError, "masked array"),
            ("bgr", "stretch", np.zeros((4, 4), np.uint8), InputValueError, r"H x W x 3 uint8, got shape \(4, 4\)"),
            ("bgr", "stretch", np.zeros((4, 4, 4), np.uint8), InputValueError, r"got shape \(4, 4, 4\)"),
            ("bgra", "stretch", np.zeros((4, 4, 3), np.uint8), InputValueError, r"H x W x 4 uint8, got shape \(4, 4, 3\)"),
            ("rgb", "stretch", np.zeros((0, 4, 3), np.uint8), InputValueError, r"got shape \(0, 4, 3\)"),
            ("nv12", "stretch", np.zeros((6, 4, 1), np.uint8), InputValueError, r"nv12 frame is one \(H\*3/2\) x W .* \(6, 4, 1\)"),
            ("nv12", "stretch", np.zeros((7, 4), np.uint8), InputValueError, r"got shape \(7, 4\)"),
            ("nv12", "stretch", np.zeros((0, 4), np.uint8), InputValueError, r"got shape \(0, 4\)"),
            ("nv12", "stretch", np.zeros((6, 5), np.uint8), InputValueError, r"even width, got 5 \(array shape \(6, 5\)\)"),
            ("bgr", "stretch", np.zeros((1921, 8, 3), np.uint8), InputValueError, r"1921x8 frame is larger than max_frame=\(1080, 1920\)"),
            ("bgr", "stretch", np.zeros((1081, 1081, 3), np.uint8), InputValueError, "1081x1081 frame is larger"),
            ("bgr", "letterbox", np.zeros((8, 1921, 3), np.uint8), InputValueError, "8x1921 frame is larger"),
            ("nv12", "stretch", np.zeros((2883, 8), np.uint8), InputValueError, "1922x8 frame is larger"),
            ("bgr", None, np.zeros((8, 9, 3), np.uint8), InputValueError, "with resize=None a frame must be the model's 8x8, got 8x9"),
            ("nv12", None, np.zeros((15, 8), np.uint8), InputValueError, "must be the model's 8x8, got 10x8"),
            ("i420", "stretch", np.zeros((6, 4, 1), np.uint8), InputValueError, r"i420 frame is one \(H\*3/2\) x W uint8 array \(Y plane, then U plane, V plane\), got shape \(6, 4, 1\)"),
            ("i420", "stretch", np.zeros((8, 4), np.uint8), InputValueError, r"got shape \(8, 4\)"),
            ("i420", "stretch", np.zeros((9, 7), np.uint8), InputValueError, r"i420 frame has an even width, got 7"),
            ("i420", "stretch", np.zeros((2883, 8), np.uint8), InputValueError, "1922x8 frame is larger"),
            ("i420", None, np.zeros((15, 8), np.uint8), InputValueError, "must be the model's 8x8, got 10x8"),
        ],
    )  # fmt: skip
    def test_check_frame_errors(
        self, source: str, resize: Any, value: Any, error: type[Exception], match: str
    ) -> None:
        pre = ImagePreprocess(source=source, order="rgb", resize=resize)  # type: ignore[arg-type]
        with pytest.raises(error, match=match) as info:
            pre.check_frame(value, spec(8, 8))
        assert str(info.value).startswith("input 'images': ")
        with pytest.raises(error, match=match):
            pre.apply(value, spec(8, 8))

    def test_check_frame_passes_arrays_through(self) -> None:
        pre = ImagePreprocess(source="nv12", order="rgb", resize=None)
        image = frame("nv12", 8, 8)
        assert pre.check_frame(image, spec(8, 8)) is image
        largest = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
        largest.check_frame(np.zeros((1080, 1920, 3), np.uint8), spec(640, 640))

    def test_out(self) -> None:
        pre = ImagePreprocess(source="bgr", order="bgr", resize="letterbox")
        image = frame("bgr", 30, 40)
        out = np.full((1, 3, 16, 16), np.nan, np.float32)
        assert pre.apply(image, spec(16, 16), out) is out
        assert np.array_equal(out, pre.apply(image, spec(16, 16)))
        for bad in (np.empty((1, 3, 16, 15), np.float32), np.empty((1, 3, 16, 16), np.float16)):
            with pytest.raises(
                InputValueError,
                match=r"input 'images': out must be float32 of shape \(1, 3, 16, 16\)",
            ):
                pre.apply(image, spec(16, 16), bad)


class TestDefinition:
    @pytest.mark.parametrize("source", SOURCES)
    @pytest.mark.parametrize("resize", ["letterbox", "stretch", None])
    @pytest.mark.parametrize(
        ("frame_size", "model_size"),
        [((12, 18), (7, 9)), ((6, 4), (11, 13)), ((18, 12), (6, 4)), ((10, 14), (10, 14))],
    )
    def test_bit_for_bit(
        self,
        source: str,
        resize: Any,
        frame_size: tuple[int, int],
        model_size: tuple[int, int],
    ) -> None:
        """apply is the docstring's arithmetic to the bit: downscaling, upscaling, an
        exact 3x (whose interpolation apply skips) and equal sizes, odd model sizes."""
        if resize is None:
            model_size = frame_size
        order = "bgr" if source in ("rgb", "bgra") else "rgb"
        pre = ImagePreprocess(source=source, order=order, resize=resize, mean=MEAN, std=STD)  # type: ignore[arg-type]
        image = frame(source, *frame_size, seed=sum(frame_size))
        out = pre.apply(image, spec(*model_size))
        assert out.dtype == np.float32 and out.shape == (1, 3, *model_size)
        np.testing.assert_array_equal(out, definition(pre, image, *model_size))

    def test_resize_none_is_the_pixels(self) -> None:
        pre = ImagePreprocess(source="bgra", order="rgb", resize=None, scale=1.0)
        image = frame("bgra", 5, 7)
        out = pre.apply(image, spec(5, 7))
        assert np.array_equal(out[0], image[..., 2::-1].transpose(2, 0, 1))

    def test_views_and_frame_sizes(self) -> None:
        """Non-contiguous frames, and frame sizes that change from call to call."""
        pre = ImagePreprocess(source="rgb", order="rgb", resize="letterbox", pad_value=0)
        image = frame("rgb", 40, 60)
        for view in (image[5:33, 7:50], image[::2, ::3], image[:, ::-1]):
            np.testing.assert_array_equal(
                pre.apply(view, spec(16, 24)), pre.apply(view.copy(), spec(16, 24))
            )
            np.testing.assert_array_equal(
                pre.apply(view, spec(9, 11)), definition(pre, view, 9, 11)
            )

    @pytest.mark.parametrize("source", PLANAR)
    def test_constant_frame_stays_constant(self, source: str) -> None:
        pre = ImagePreprocess(source=source, order="rgb", resize="stretch", scale=1.0)  # type: ignore[arg-type]
        image = np.full((15, 8), 128, np.uint8)
        image[:10] = 126  # Y 126, U = V = 128: grey 128 exactly
        assert (pre.apply(image, spec(37, 29)) == 128).all()

    def test_i420_planes(self) -> None:
        """i420's U and V are whole planes: a frame made of a U plane of one level and a
        V plane of another gives one colour everywhere, which nv12 read of the same
        bytes would not (it takes U and V from alternate bytes)."""
        height, width = 6, 8  # 6 rows: the V plane starts mid-row
        image = np.empty((height * 3 // 2, width), np.uint8)
        image[:height] = 90
        chroma = image[height:].reshape(-1)
        chroma[: height * width // 4] = 200  # U
        chroma[height * width // 4 :] = 60  # V
        i420 = ImagePreprocess(source="i420", order="rgb", resize=None, scale=1.0)
        out = i420.apply(image, spec(height, width))
        colour = out[0, :, 0, 0]
        assert (out[0] == colour[:, None, None]).all()
        # R, G, B of Y 90, U 200, V 60 by the docstring's formula
        luma = (90 - 16) * 1220542 + 2**19
        u, v = 200 - 128, 60 - 128
        expected = [
            min(max(level >> 20, 0), 255)
            for level in (luma + 1673527 * v, luma - 852492 * v - 409993 * u, luma + 2116026 * u)
        ]
        assert colour.tolist() == expected
        nv12 = ImagePreprocess(source="nv12", order="rgb", resize=None, scale=1.0)
        assert not (nv12.apply(image, spec(height, width)) == colour[:, None, None]).all()

    def test_i420_strided_is_its_copy(self) -> None:
        """A pitched i420 frame (rows further apart than their bytes, as decoders give
        them) is read by its array indices: the same as its dense copy."""
        pre = ImagePreprocess(source="i420", order="bgr", resize="letterbox", pad_value=0)
        big = frame("bgr", 30, 40)[..., 0]
        view = big[:, :26]  # (30, 26): a 20 x 26 frame with a pitch of 40 bytes
        np.testing.assert_array_equal(
            pre.apply(view, spec(16, 24)), pre.apply(view.copy(), spec(16, 24))
        )
        np.testing.assert_array_equal(pre.apply(view, spec(9, 11)), definition(pre, view, 9, 11))


class TestAgainstOpenCV:
    @staticmethod
    def reference(cv2: Any, pre: ImagePreprocess, image: Any, height: int, width: int) -> Any:
        codes = {
            "bgr": cv2.COLOR_BGR2RGB,
            "bgra": cv2.COLOR_BGRA2RGB,
            "rgba": cv2.COLOR_RGBA2RGB,
            "nv12": cv2.COLOR_YUV2RGB_NV12,
            "i420": cv2.COLOR_YUV2RGB_I420,
        }
        rgb = image if pre.source == "rgb" else cv2.cvtColor(image, codes[pre.source])
        picture = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR) if pre.order == "bgr" else rgb
        rows, columns = picture.shape[:2]
        if pre.resize == "stretch":
            picture = cv2.resize(picture, (width, height), interpolation=cv2.INTER_LINEAR)
        elif pre.resize == "letterbox":
            s = min(height / rows, width / columns)
            h, w = round(rows * s), round(columns * s)
            top, left = (height - h) // 2, (width - w) // 2
            resized = cv2.resize(picture, (w, h), interpolation=cv2.INTER_LINEAR)
            picture = cv2.copyMakeBorder(
                resized, top, height - h - top, left, width - w - left,
                cv2.BORDER_CONSTANT, value=(pre.pad_value,) * 3,
            )  # fmt: skip
        x = picture.astype(np.float32).transpose(2, 0, 1)[None]
        mean = np.array(pre.mean, np.float32).reshape(3, 1, 1)
        std = np.array(pre.std, np.float32).reshape(3, 1, 1)
        return (x * np.float32(pre.scale) - mean) / std

    @pytest.mark.parametrize("source", SOURCES)
    @pytest.mark.parametrize("resize", ["letterbox", "stretch", None])
    @pytest.mark.parametrize("order", ["rgb", "bgr"])
    @pytest.mark.parametrize(("frame_size", "model_size"), CASES)
    def test_within_one_level(
        self,
        cv2: Any,
        source: str,
        resize: Any,
        order: str,
        frame_size: tuple[int, int],
        model_size: tuple[int, int],
    ) -> None:
        """Within one level (scale / std[k]) of OpenCV's uint8 pipeline, which rounds
        its resized pixels; resize=None is exact."""
        if resize is None:
            model_size = frame_size
        keywords: dict[str, Any] = {"source": source, "order": order, "resize": resize}
        pre = ImagePreprocess(**keywords, mean=MEAN, std=STD, pad_value=114)
        image = frame(source, *frame_size)
        out = pre.apply(image, spec(*model_size))
        expected = self.reference(cv2, pre, image, *model_size)
        level = np.float32(pre.scale) / np.array(STD, np.float32).reshape(1, 3, 1, 1)
        error = np.abs(out - expected) / level
        assert error.max() <= (0 if resize is None else 1 + 1e-3)

    @pytest.mark.parametrize("resize", ["letterbox", "stretch"])
    @pytest.mark.parametrize(("frame_size", "model_size"), CASES)
    def test_opencv_float_resize(
        self, cv2: Any, resize: Any, frame_size: tuple[int, int], model_size: tuple[int, int]
    ) -> None:
        """OpenCV's float32 resize (no fixed point, no rounding) samples where apply does:
        they agree to float32 rounding, far tighter than the one-level bound."""
        pre = ImagePreprocess(source="rgb", order="rgb", resize=resize, scale=1.0)
        image = frame("rgb", *frame_size)
        rows, columns = frame_size
        g = pre.geometry(*frame_size, *model_size)
        h, w = round(rows * g.scale_y), round(columns * g.scale_x)
        expected = cv2.resize(image.astype(np.float32), (w, h), interpolation=cv2.INTER_LINEAR)
        out = pre.apply(image, spec(*model_size))[0, :, g.top : g.top + h, g.left : g.left + w]
        assert np.abs(out - expected.transpose(2, 0, 1)).max() <= 1e-3

    def test_nv12_every_colour(self, cv2: Any) -> None:
        """Every (Y, U, V) triple converts exactly as OpenCV's COLOR_YUV2RGB_NV12: 64
        frames of 512 x 512, each UV pair over four Y values, 65536 pairs a frame."""
        pre = ImagePreprocess(source="nv12", order="rgb", resize=None, scale=1.0)
        levels = np.arange(256, dtype=np.uint8)
        uv = np.empty((256, 512), np.uint8)
        uv[:, 0::2] = levels[:, None]  # U by row
        uv[:, 1::2] = levels[None, :]  # V by pair
        for k in range(64):
            luma = np.empty((512, 512), np.uint8)
            for dy in (0, 1):
                for dx in (0, 1):
                    luma[dy::2, dx::2] = 4 * k + 2 * dy + dx
            image = np.concatenate([luma, uv])
            out = pre.apply(image, spec(512, 512))
            expected = cv2.cvtColor(image, cv2.COLOR_YUV2RGB_NV12).transpose(2, 0, 1)
            assert np.array_equal(out[0], expected), k

    def test_i420_every_colour(self, cv2: Any) -> None:
        """Every (Y, U, V) triple converts exactly as OpenCV's COLOR_YUV2RGB_I420: 64
        frames of 512 x 512, each (U, V) pair over four Y values."""
        pre = ImagePreprocess(source="i420", order="rgb", resize=None, scale=1.0)
        levels = np.arange(256, dtype=np.uint8)
        # the 256 x 256 chroma planes: U by row, V by column
        u_plane = np.repeat(levels[:, None], 256, axis=1)
        v_plane = np.repeat(levels[None, :], 256, axis=0)
        chroma = np.concatenate([u_plane.ravel(), v_plane.ravel()]).reshape(256, 512)
        for k in range(64):
            luma = np.empty((512, 512), np.uint8)
            for dy in (0, 1):
                for dx in (0, 1):
                    luma[dy::2, dx::2] = 4 * k + 2 * dy + dx
            image = np.concatenate([luma, chroma])
            out = pre.apply(image, spec(512, 512))
            expected = cv2.cvtColor(image, cv2.COLOR_YUV2RGB_I420).transpose(2, 0, 1)
            assert np.array_equal(out[0], expected), k

    @pytest.mark.parametrize("source", ["nv12", "i420"])
    def test_full_range_every_colour(self, cv2: Any, source: str) -> None:
        """color_range="full" converts every (Y, U, V) triple exactly as OpenCV's
        COLOR_YCrCb2RGB (BT.601 full range, as JPEG codes it) of Y and its pixel's
        chroma: 64 frames of 512 x 512, each (U, V) pair over four Y values. The limited
        range's conversion of the same planes differs (by up to 37 levels at black)."""
        pre = ImagePreprocess(
            source=source, order="rgb", resize=None, scale=1.0, color_range="full"
        )
        limited = ImagePreprocess(source=source, order="rgb", resize=None, scale=1.0)
        levels = np.arange(256, dtype=np.uint8)
        u_plane = np.repeat(levels[:, None], 256, axis=1)  # U by row, V by column
        v_plane = np.repeat(levels[None, :], 256, axis=0)
        if source == "nv12":
            chroma = np.stack([u_plane, v_plane], axis=-1).reshape(256, 512)
        else:
            chroma = np.concatenate([u_plane.ravel(), v_plane.ravel()]).reshape(256, 512)
        # each pixel's (Cr, Cb): its 2 x 2 block's chroma sample
        cr = np.repeat(np.repeat(v_plane, 2, axis=0), 2, axis=1)
        cb = np.repeat(np.repeat(u_plane, 2, axis=0), 2, axis=1)
        for k in range(64):
            luma = np.empty((512, 512), np.uint8)
            for dy in (0, 1):
                for dx in (0, 1):
                    luma[dy::2, dx::2] = 4 * k + 2 * dy + dx
            image = np.concatenate([luma, chroma])
            out = pre.apply(image, spec(512, 512))
            ycrcb = np.dstack([luma, cr, cb])
            expected = cv2.cvtColor(ycrcb, cv2.COLOR_YCrCb2RGB).transpose(2, 0, 1)
            assert np.array_equal(out[0], expected), k
            if k == 0:
                assert np.abs(limited.apply(image, spec(512, 512))[0] - expected).max() > 30
