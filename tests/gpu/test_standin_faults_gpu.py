"""A DLA task fault on the GPU stand-in, in both ways hybrid mode surfaces one (issue 16).

``StandinControls.fail_next_task(core, status, on_stream=False)`` is the call of
``EmulatedRuntime.fail_next_task``, with the same two modes:

- by default the fault shows only through ``cudlaGetLastError``: that request fails with
  ``TaskError`` and the engine keeps serving (tested here, in this process);
- ``on_stream=True`` also raises a sticky CUDA error on the task's stream, as a DLA
  hardware fault does (NVIDIA's cuDLAErrorReporting sample: cudaErrorExternalDevice).
  The stand-in's kernel publishes the status, then traps: the CUDA context is lost for
  the whole process, with cudaErrorLaunchFailure (719) or, by driver and GPU,
  cudaErrorIllegalInstruction (715). So those scenarios run in a child process, as the
  poisoned-context test of test_engine_gpu.py does: this very file, run as a script
  (``python test_standin_faults_gpu.py SCENARIO [--host-fake]``), which checks what it
  sees and prints one JSON line, ``{"facts": ..., "problems": [...]}``.

The children's test names contain ``poisoned_context``: tests/gpu/sanitize/sanitize.sh
keeps deliberate traps out of its ordinary runs by that name. In the host-fake dry run
(``AIODLA_GPU_TESTS=host-fake``) the children run too: the host-fake build loses its
fake context at the faulting task and tests/gpu/_host_fake.py reports the sticky error
from every later call; only the gate (a task held on the GPU) is left out there.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodla import ConfigurationError, Engine, EngineDeadError, TaskError, TensorSpec
from aiodla.emulator._format import make_loadable, parse_loadable
from aiodla.emulator._ops import compute_logical, run_model, to_storage
from aiodla.emulator._standin import StandinControls, load_standin
from aiodla.runtime import CudaCallError
from aiodla.runtime._cuda import CudaRuntime
from aiodla.runtime._protocol import cudla_status

from _setup import ModelSetup

pytestmark = pytest.mark.gpu

ENGINE_TIMEOUT = 0x40000006
CUDLA_ERROR_CUDA = 6  # cudlaErrorCuda: what cudlaSubmitTask says once the context is lost
TRAP_ERRORS = (715, 719)  # cudaErrorIllegalInstruction, cudaErrorLaunchFailure
NO_HANDLES = {"devices": 0, "modules": 0, "registrations": 0}
NOTHING_LIVE = {"allocations": 0, "bytes": 0, "events": 0, "streams": 0}
X = TensorSpec("x", (1, 16, 4, 4), "float16", "chw16")
Y = TensorSpec("y", (1, 16, 4, 4), "float16", "nchw")
CHILD_SECONDS = 120


def loadable(latency: float = 0.002) -> bytes:
    return make_loadable([X], [Y], "affine", latency, scale=0.5, bias=1.0)


def expected_output(data: bytes, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return to_storage(compute_logical(parse_loadable(data), 0, x), Y.numpy_dtype)


INPUT = (np.arange(256, dtype=np.float64).reshape(X.shape) * 0.25 - 8).astype(np.float16)


# -- in this process: the default mode ----------------------------------------------------


@pytest.fixture
def cuda_runtime(gpu_session: Any) -> Any:
    runtime = CudaRuntime(0)
    yield runtime
    runtime.close()


class TestFaultThroughLastError:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("on_stream", [None, False], ids=["default", "on_stream_false"])
    async def test_fails_only_its_request(
        self, cuda_runtime: CudaRuntime, standin: StandinControls, on_stream: bool | None
    ) -> None:
        data = loadable()
        want = expected_output(data, INPUT)
        async with Engine(data, cores=(0,), runtime=cuda_runtime) as engine:
            np.testing.assert_array_equal(await engine.infer(INPUT), want)
            if on_stream is None:
                standin.fail_next_task(0, ENGINE_TIMEOUT)
            else:
                standin.fail_next_task(0, ENGINE_TIMEOUT, on_stream=on_stream)
            with pytest.raises(TaskError) as caught:
                await engine.infer(INPUT)
            assert caught.value.status == ENGINE_TIMEOUT and caught.value.core == 0
            np.testing.assert_array_equal(await engine.infer(INPUT), want)
            assert not engine.dead
            assert engine.health().status != "dead"
            assert standin.context_error == 0
        assert standin.live_handles() == NO_HANDLES


class TestControls:
    def test_arguments_are_checked(self, standin: StandinControls) -> None:
        with pytest.raises(ConfigurationError, match="status=0"):
            standin.fail_next_task(0, 0, on_stream=True)
        with pytest.raises(ConfigurationError, match="core="):
            standin.fail_next_task(standin.cores, ENGINE_TIMEOUT, on_stream=True)
        with pytest.raises(ValueError, match="not a valid Status"):
            standin.fail_next_task(0, 0x12345, on_stream=True)
        # The C entry point refuses a mode other than 0 and 1 (cudlaErrorInvalidParam).
        assert standin.library.aiodlaStandinFailNextTask(0, ENGINE_TIMEOUT, 2) == 1
        assert standin.context_error == 0


# -- in a child process: the fault on the stream -------------------------------------------


def run_child(scenario: str, library: Path, host_fake: bool) -> dict[str, Any]:
    """Run a scenario of this file in a fresh process; its facts, after its own checks."""
    command = [sys.executable, str(Path(__file__).resolve()), scenario]
    if host_fake:
        command.append("--host-fake")
    env = {**os.environ, "AIODLA_STANDIN_LIB": str(library)}
    process = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=CHILD_SECONDS, check=False
    )
    assert process.returncode == 0, process.stderr[-3000:]
    report: dict[str, Any] = json.loads(process.stdout.strip().splitlines()[-1])
    assert report["problems"] == [], (report, process.stderr[-3000:])
    return report


class TestFaultOnTheStream:
    def test_poisoned_context_by_a_task_fault_at_the_runtime(self, gpu_session: Any) -> None:
        report = run_child("runtime", gpu_session.library, gpu_session.host_fake)
        assert report["facts"]["seen"] in TRAP_ERRORS

    def test_poisoned_context_by_a_task_fault_kills_the_engine(self, gpu_session: Any) -> None:
        report = run_child("engine", gpu_session.library, gpu_session.host_fake)
        assert report["facts"]["outcomes"] == ["EngineDeadError"] * 6


# -- the child's side -------------------------------------------------------------------------


class Checks:
    """What a child saw (``facts``) and which of its expectations failed (``problems``)."""

    def __init__(self) -> None:
        self.facts: dict[str, Any] = {}
        self.problems: list[str] = []

    def equal(self, name: str, got: Any, want: Any) -> None:
        self.facts[name] = got
        if got != want:
            self.problems.append(f"{name}: got {got!r}, want {want!r}")

    def within(self, name: str, got: Any, allowed: Any) -> None:
        self.facts[name] = got
        if got not in allowed:
            self.problems.append(f"{name}: got {got!r}, want one of {allowed!r}")


def cuda_code(call: Any, *args: Any) -> int | str:
    """The cudaError_t a CUDA call fails with, or what it did instead."""
    try:
        call(*args)
    except CudaCallError as exc:
        return exc.code
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def cudla_code(call: Any, *args: Any) -> int | str:
    """The cudlaStatus a cuDLA call fails with, or what it did instead."""
    try:
        call(*args)
    except Exception as exc:
        status = cudla_status(exc)
        return f"{type(exc).__name__}: {exc}" if status is None else status
    return "no error"


def start_child(host_fake: bool) -> StandinControls:
    """Load the stand-in before anything binds libcudla; in a dry run, the CUDA fake."""
    controls = load_standin(os.environ["AIODLA_STANDIN_LIB"])
    if host_fake:
        import aiodla.runtime._cuda as cuda_module

        from _host_fake import HostFakeRuntime

        cuda_module._rt = HostFakeRuntime(controls)
    return controls


def runtime_child(controls: StandinControls, host_fake: bool) -> Checks:
    """The runtime calls alone: the fault's sticky error, the status, the releases."""
    checks = Checks()
    runtime = CudaRuntime(0)
    runtime.make_current()
    data = loadable()
    buffers = [X.pack(INPUT).tobytes()]
    want = np.zeros(Y.size, dtype=np.uint8)
    run_model(parse_loadable(data), [np.frombuffer(buffers[0], dtype=np.uint8)], [want])
    first = ModelSetup(runtime, 0, data)
    behind = ModelSetup(runtime, 0, data)  # a second handle: its task queues behind
    other = ModelSetup(runtime, 1, data)
    checks.equal("good", first.run(buffers) == ([want.tobytes()], 0), True)
    first.fill_outputs(0xAB)
    controls.fail_next_task(0, ENGINE_TIMEOUT, on_stream=True)
    seen: int | str = "no error"
    try:
        if host_fake:
            # The fake runs the task inside submit: the copy out behind it fails.
            first.enqueue(buffers)
        else:
            gate = controls.hold(0)
            try:
                first.enqueue(buffers)
                checks.equal("held", gate.wait_for_held(1, timeout=10.0), True)
                behind.enqueue(buffers)  # on core 0's chain, after the faulting task
            finally:
                gate.release()
        runtime.synchronize_stream(first.stream)
    except CudaCallError as exc:
        seen = exc.code
        checks.equal("seen_sticky", exc.sticky, True)
    checks.within("seen", seen, TRAP_ERRORS)
    if not host_fake:
        checks.equal("behind_sync", cuda_code(runtime.synchronize_stream, behind.stream), seen)
    # The DLA's own word on the fault, latched once; the task wrote no output.
    checks.equal("status", runtime.get_last_error(first.device), ENGINE_TIMEOUT)
    checks.equal("status_again", runtime.get_last_error(first.device), 0)
    checks.equal("behind_status", runtime.get_last_error(behind.device), 0)
    checks.equal("other_status", runtime.get_last_error(other.device), 0)
    checks.equal("outputs_untouched", first.results() == [b"\xab" * Y.size], True)
    # Every later CUDA call fails with the same sticky error; cuDLA cannot submit.
    later = [
        cuda_code(runtime.malloc, 256),
        cuda_code(runtime.create_stream),
        cuda_code(
            runtime.copy_to_device, other.device_in[0], other.host_in[0], X.size, other.stream
        ),
    ]
    checks.equal("later", later, [seen] * 3)
    checks.equal(
        "submit_elsewhere",
        cudla_code(runtime.submit_task, other.device, other.task, other.stream),
        CUDLA_ERROR_CUDA,
    )
    checks.equal("context_error", controls.context_error, seen)
    # Releasing: the CUDA releases fail (the context is gone), the cuDLA ones must not,
    # the handle whose task never ran included.
    close_errors = []
    for setup in (other, behind, first):
        try:
            setup.close()
        except Exception as exc:
            close_errors.append(type(exc).__name__)
    checks.facts["close_errors"] = close_errors
    checks.equal("close_errors_only_cuda", set(close_errors) <= {"CudaCallError"}, True)
    checks.equal("handles", controls.live_handles(), NO_HANDLES)
    checks.equal("resources", controls.live_resources(), NOTHING_LIVE)
    return checks


class _RecordingRuntime(CudaRuntime):
    """CudaRuntime that remembers the device handle it made for each core, so the child
    can ask cuDLA for a core's status after the engine died."""

    def __init__(self, device: int = 0) -> None:
        super().__init__(device)
        self.devices: dict[int, int] = {}

    def create_device(self, core: int) -> int:
        handle = super().create_device(core)
        self.devices[core] = handle
        return handle


async def _wait_until(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.001)
    return True


async def engine_child(controls: StandinControls, host_fake: bool) -> Checks:
    """The engine in this process dies as on the emulated runtime, and leaks nothing."""
    checks = Checks()
    data = loadable()
    want = expected_output(data, INPUT)
    runtime = _RecordingRuntime(0)
    # A task timeout far above the test's waits: a held task must not time out first.
    engine = Engine(data, runtime=runtime, cores=(0,), streams_per_core=2, task_timeout=30.0)
    await engine.open()
    checks.equal("good", np.array_equal(await engine.infer(INPUT), want), True)
    controls.fail_next_task(0, ENGINE_TIMEOUT, on_stream=True)
    if host_fake:
        requests = [asyncio.create_task(engine.infer(INPUT)) for _ in range(6)]
    else:
        # Both slots in flight, the first task at the gate and four requests queued: the
        # first traps, the second never runs, the queued ones never reach the DLA.
        gate = controls.hold(0)
        try:
            requests = [asyncio.create_task(engine.infer(INPUT)) for _ in range(6)]
            stats_ready = await _wait_until(
                lambda: engine.statistics().in_flight == 2 and gate.held == 1
            )
            checks.equal("held", stats_ready, True)
        finally:
            gate.release()
    outcomes = await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), 30)
    checks.equal("outcomes", [type(o).__name__ for o in outcomes], ["EngineDeadError"] * 6)
    causes = [o.__cause__ for o in outcomes if isinstance(o, EngineDeadError)]
    codes = sorted({c.code for c in causes if isinstance(c, CudaCallError)})
    checks.equal("cause_types", sorted({type(c).__name__ for c in causes}), ["CudaCallError"])
    checks.equal("cause_sticky", all(getattr(c, "sticky", False) for c in causes), True)
    checks.within("cause_codes", tuple(codes), [(code,) for code in TRAP_ERRORS])
    cause = codes[0] if len(codes) == 1 else None
    # cudaErrorExternalDevice-like errors say "a DLA broke"; cuDLA says how.
    checks.equal("status", runtime.get_last_error(runtime.devices[0]), ENGINE_TIMEOUT)
    try:
        await engine.infer(INPUT)
        refused = "served"
    except EngineDeadError:
        refused = "EngineDeadError"
    except Exception as exc:
        refused = type(exc).__name__
    checks.equal("refused", refused, "EngineDeadError")
    checks.equal("health", engine.health().status, "dead")
    checks.equal("dead", engine.dead, True)
    began = time.monotonic()
    await asyncio.wait_for(engine.aclose(), 30)
    checks.facts["close_seconds"] = time.monotonic() - began
    checks.equal("closed_in_time", checks.facts["close_seconds"] < 15, True)
    checks.equal("state", engine.state.value, "closed")
    stats = engine.statistics()
    checks.equal(
        "counts",
        {
            "completed": stats.completed,
            "dead": stats.failures["dead"],
            "in_flight": stats.in_flight,
            "queued": stats.queued,
        },
        {"completed": 1, "dead": stats.submitted - 1, "in_flight": 0, "queued": 0},
    )
    checks.equal("failed", stats.failed, stats.submitted - 1)
    checks.equal("handles", controls.live_handles(), NO_HANDLES)
    checks.equal("resources", controls.live_resources(), NOTHING_LIVE)
    checks.equal("context_error", controls.context_error, cause)
    return checks


def child_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="a sticky-fault scenario, in this process")
    parser.add_argument("scenario", choices=("runtime", "engine"))
    parser.add_argument("--host-fake", action="store_true", help="the host-fake dry run")
    args = parser.parse_args(argv)
    controls = start_child(args.host_fake)
    if args.scenario == "runtime":
        checks = runtime_child(controls, args.host_fake)
    else:
        checks = asyncio.run(engine_child(controls, args.host_fake))
    print(json.dumps({"facts": checks.facts, "problems": checks.problems}, default=repr))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    # The context is lost: libraries' own teardown (freeing what the CUDA runtime and
    # the stand-in still hold) would only fail now, so leave without it, failing or not.
    try:
        code = child_main(sys.argv[1:])
    except SystemExit as exc:  # argparse's usage errors (2)
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        code = 1
    os._exit(code)
