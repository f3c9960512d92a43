"""Test your asyncio application against an emulated DLA, in CI with no GPU.

Installing aiodla registers a pytest plugin (``aiodla.testing.plugin``) that brings
two fixtures; it does nothing in tests that do not use them. They need pytest-asyncio
(strict or auto mode): mark the tests ``@pytest.mark.asyncio``. pytest loads the plugin
by itself: naming it in ``pytest_plugins`` as well makes pytest refuse to start
("Plugin already registered under a different name"); ``-p no:aiodla`` disables it.

``aiodla_engine``
    An async factory: ``engine = await aiodla_engine(spec, **options)`` returns an
    open :class:`aiodla.Engine` on an emulated DLA with two cores. Describe the model
    by ``spec`` — the JSON file that ``aiodla inspect model.bin --json`` writes on the
    Jetson, that JSON as a dict, or emulator loadable bytes — or by
    ``inputs=[TensorSpec(...)], outputs=[...]``. ``latency=`` (seconds per task on one
    core, default 1 ms), ``op=``, ``scale=``, ``bias=`` choose what the emulator
    computes (see :func:`emulated_model`), or ``compute=`` your own function of the
    inputs by name, returning the outputs by name (``aiodla.emulator.onnx_compute``
    and ``aiodla.emulator.replay`` make such functions of an ONNX network and of a
    recording); other keywords go to ``Engine`` (``cores``,
    ``max_queue``, ``max_consecutive_faults``, ...). Every engine it opened is closed
    at teardown, after releasing any gate the test left standing.

``aiodla_controls``
    :class:`DLAControls` for that emulated DLA (the same one ``aiodla_engine`` uses),
    to reach states without sleeping:

    - ``fail_next(core=None, *, status=..., count=1)``: the next task(s) fail, wherever
      they go or on ``core``; the request raises :class:`aiodla.TaskError`.
    - ``delay_next(seconds, *, core=None)``: the next task starts ``seconds`` late.
    - ``hold(*cores) -> Gate``: tasks on those cores (all when none are given) stay in
      flight until ``gate.release()`` or the end of ``with controls.hold() as gate:``;
      ``await gate.reached(n)`` waits, without blocking the loop, until ``n`` tasks
      are held.
    - ``poison()``: a sticky CUDA error; engines die (:class:`aiodla.EngineDeadError`).
    - ``runtime``: the :class:`~aiodla.EmulatedRuntime`, for ``Engine(model,
      runtime=aiodla_controls.runtime)`` when your application opens its own engine.

    At teardown it fails the test if an engine opened on ``runtime`` left a handle
    alive (an engine the application never closed).

A test, as it reads in a user's suite::

    import pytest
    from aiodla import TaskError

    @pytest.mark.asyncio
    async def test_a_failed_frame_is_skipped(aiodla_engine, aiodla_controls):
        engine = await aiodla_engine("tests/model-spec.json")
        aiodla_controls.fail_next()
        assert await my_app.classify(engine, frame) is None   # TaskError handled

Every model's I/O can be emulated: when each output has its input's shape
(``affine``) or is its input's NxCx1x1 (``mean_hw``) the outputs are computed from
input i; otherwise (a classifier, a detector with several heads) ``mix`` makes every
output element a deterministic hash of all the request's input elements and of its
own position, so a lost, swapped or mixed-up input shows as wrong numbers.

For video sources: :func:`encode_clip` writes an H.264 or H.265 clip with PyAV (every
frame different), and :class:`RtspServer` serves clips over RTSP with GStreamer's
gst-rtsp-server in a process of its own (Debian: ``python3-gi``,
``gir1.2-gst-rtsp-server-1.0`` and the base, good and bad plugins), stoppable and
restartable on its port to test reconnecting.
"""

from ._controls import DLA_TASK_FAILURE as DLA_TASK_FAILURE
from ._controls import DLAControls as DLAControls
from ._controls import EngineFactory as EngineFactory
from ._controls import Gate as Gate
from ._controls import HandleLeakError as HandleLeakError
from ._model import ModelDescription as ModelDescription
from ._model import emulated_model as emulated_model
from ._video import RtspServer as RtspServer
from ._video import encode_clip as encode_clip

__all__ = (
    "DLA_TASK_FAILURE",
    "DLAControls",
    "EngineFactory",
    "Gate",
    "HandleLeakError",
    "ModelDescription",
    "RtspServer",
    "emulated_model",
    "encode_clip",
)
