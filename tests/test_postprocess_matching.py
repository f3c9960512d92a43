"""An engine's Detect matched to its model at open (``open_postprocess``) and run on each
request (``Postprocess``): which input is the image, the refusals word for word, a
failure wrapped with its cause, and the bound on the frame sizes whose geometry is kept."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from aiodla import (
    ConfigurationError,
    Detect,
    Detections,
    Engine,
    ImagePreprocess,
    PostprocessError,
    TensorSpec,
)
from aiodla._postprocess import Postprocess, open_postprocess
from aiodla.emulator import make_loadable

# Small heads (a 16x16 input, strides 4 and 8), so that every request is quick.
IMAGES = TensorSpec("images", (1, 3, 16, 16), "float16", "nchw")
EXTRA = TensorSpec("extra", (1, 1, 1, 1), "float16", "nchw")
HEADS = (
    TensorSpec("a", (1, 21, 4, 4), "float16", "nchw"),
    TensorSpec("b", (1, 21, 2, 2), "float16", "nchw"),
)
DETECT = Detect(head="yolov5", classes=2, strides=(4, 8), anchors=((2, 3, 4, 5, 6, 7),) * 2)
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")


def frame(height: int, width: int, seed: int = 0) -> Any:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)


def postprocess_of(engine: Engine) -> Postprocess:
    post = engine._flow.postprocess  # type: ignore[union-attr]
    assert isinstance(post, Postprocess)
    return post


def frame_of(post: Postprocess, inputs: list[Any]) -> tuple[Any, tuple[int, int]]:
    """Where the request's frame lands, and its size (the engines here map boxes)."""
    found = post.frame_of(inputs)
    assert found is not None
    return found


class TestTheImageInput:
    @pytest.mark.asyncio
    async def test_is_the_one_preprocess_names_wherever_it_stands(self) -> None:
        # The image is the model's second input: the heads are matched to its size and
        # the boxes mapped into the frame each request gave it.
        model = make_loadable([EXTRA, IMAGES], HEADS, "detect", 0.002)
        async with Engine(model, postprocess=DETECT, preprocess={"images": LETTERBOX}) as engine:
            post = postprocess_of(engine)
            assert post.plan.input_size == (16, 16)
            for height, width in ((48, 64), (30, 20)):
                got = await engine.infer(
                    {"extra": np.zeros(EXTRA.shape, np.float32), "images": frame(height, width)}
                )
                assert isinstance(got, Detections)
                geometry, size = frame_of(post, [np.zeros(EXTRA.shape), frame(height, width)])
                assert size == (height, width)
                assert geometry == LETTERBOX.geometry(height, width, 16, 16)

    @pytest.mark.asyncio
    async def test_of_a_model_of_several_inputs_must_be_named(self) -> None:
        model = make_loadable([IMAGES, EXTRA], HEADS, "detect", 0.002)
        engine = Engine(model, postprocess=DETECT)
        with pytest.raises(ConfigurationError) as refused:
            await engine.open()
        assert str(refused.value) == (
            "postprocess=Detect(...) needs to know the image input of a model with 2 inputs "
            "(images, extra): give it preprocess={name: ImagePreprocess}"
        )
        assert engine.state.value == "closed"

    def test_a_postprocess_that_is_no_detect_is_refused_by_its_repr(self) -> None:
        model = make_loadable([IMAGES], HEADS, "detect", 0.002)
        with pytest.raises(ConfigurationError) as refused:
            Engine(model, postprocess="yolov5")  # type: ignore[arg-type]
        assert str(refused.value) == "postprocess='yolov5' must be an aiodla.Detect"
        # The options refuse it first; matching at open (a worker process's too) again.
        options = SimpleNamespace(postprocess="yolov5", preprocess={})
        with pytest.raises(ConfigurationError) as refused:
            open_postprocess(options, [IMAGES], HEADS)  # type: ignore[arg-type]
        assert str(refused.value) == "postprocess='yolov5' must be an aiodla.Detect"


@pytest.mark.asyncio
async def test_a_failure_is_a_postprocess_error_that_names_its_cause() -> None:
    model = make_loadable([IMAGES], HEADS, "detect", 0.002)
    async with Engine(model, postprocess=DETECT) as engine:
        post = postprocess_of(engine)
        too_narrow = [np.zeros((1, 21, 4, 3), np.float32), np.zeros((1, 21, 2, 2), np.float32)]
        with pytest.raises(PostprocessError) as failed:
            post.run(too_narrow, [np.zeros(IMAGES.shape, np.float32)])
    cause = failed.value.__cause__
    assert cause is not None and not isinstance(cause, PostprocessError)
    assert str(failed.value) == f"post-processing failed: {cause}"


@pytest.mark.asyncio
async def test_the_geometries_kept_are_bounded_at_64_frame_sizes_and_no_sooner() -> None:
    # A camera that cycles through more frame sizes than that recomputes them: the
    # cache starts again at the 65th size, and every geometry is the preprocess's.
    model = make_loadable([IMAGES], HEADS, "detect", 0.002)
    async with Engine(model, postprocess=DETECT, preprocess={"images": LETTERBOX}) as engine:
        post = postprocess_of(engine)
        kept = []
        for width in range(1, 66):
            geometry, size = frame_of(post, [frame(8, width)])
            assert size == (8, width) and geometry == LETTERBOX.geometry(8, width, 16, 16)
            kept.append(len(post._geometries))
        assert kept[:64] == list(range(1, 65)) and kept[64] == 1
        again, _ = frame_of(post, [frame(8, 65)])  # the one size kept since
        assert again is post._geometries[(8, 65)] and len(post._geometries) == 1


@pytest.mark.asyncio
async def test_a_frame_size_seen_before_reuses_its_geometry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    computed: list[tuple[int, ...]] = []
    geometry = ImagePreprocess.geometry

    def counted(self: ImagePreprocess, *sizes: int) -> Any:
        computed.append(sizes)
        return geometry(self, *sizes)

    monkeypatch.setattr(ImagePreprocess, "geometry", counted)
    model = make_loadable([IMAGES], HEADS, "detect", 0.002)
    async with Engine(model, postprocess=DETECT, preprocess={"images": LETTERBOX}) as engine:
        post = postprocess_of(engine)
        computed.clear()  # (what the engine's open computed)
        firsts = [frame_of(post, [frame(h, w)])[0] for h, w in ((48, 64), (30, 20), (48, 64))]
        assert computed == [(48, 64, 16, 16), (30, 20, 16, 16)]
        assert firsts[2] is firsts[0]
