"""The submitter thread (``aiodla._handoff``) on its own: the C library built here, its
thread driving fake entry points (ctypes callbacks standing in for the driver's and
cuDLA's), and the library's build and cache.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aiodla._handoff import Handoff, HandoffUnavailableError, _library
from aiodla.runtime._handoff_calls import BIND, LAUNCH, RECORD, SUBMIT, HandoffCalls

from support import needs_cc

STREAM, EVENT, DEVICE, TASK = 0x5000, 0x6000, 0x7000, 0x8000
BEFORE, AFTER = 0x100, 0x200


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """One build for the module, in a directory of its own."""
    monkeypatch.setenv("AIODLA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "handoff"))


class FakeDevice:
    """Entry points that log each call and its thread, failing as told."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.threads: set[int] = set()
        self.fail_at: dict[int, int] = {}  # which call (1, 2, ...) -> status it returns
        self.gate = threading.Event()
        self.gate.set()
        self.bind_status = 0

    def _call(self, *entry: Any) -> int:
        self.gate.wait(5)
        self.threads.add(threading.get_ident())
        self.log.append(entry)
        return self.fail_at.get(len(self.log), 0)

    def calls(self, slots: int = 4, **options: Any) -> Handoff:
        def launch(graph: int, stream: int) -> int:
            return self._call("launch", graph, stream)

        def submit(device: int, task: int, count: int, stream: int, flags: int) -> int:
            return self._call("submit", device, task, count, stream, flags)

        def record(event: int, stream: int) -> int:
            return self._call("record", event, stream)

        def bind(argument: int) -> int:
            return self.bind_status

        keep = (LAUNCH(launch), SUBMIT(submit), RECORD(record), BIND(bind))
        at = [ctypes.cast(f, ctypes.c_void_p).value or 0 for f in keep]
        calls = HandoffCalls(
            *at[:4],
            bind_argument=0,
            graph_handle=int,
            task_handle=int,
            launched=None,
            failure=lambda call, code, stream: RuntimeError(f"call {call} failed: {code}"),
            keep=keep,
        )
        return Handoff(calls, slots, **{"quiet": 0.0, "linger": 0.0, **options})


def slot(number: int = 0) -> Any:
    return SimpleNamespace(
        number=number,
        task=TASK + number,
        core=SimpleNamespace(device=DEVICE),
        stream=STREAM + number,
        event=EVENT + number,
        handoff=False,
        handoff_failure=None,
    )


def wait_settled(handoff: Handoff, s: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not handoff.settled(s):
        assert time.monotonic() < deadline, "the thread never made the calls"
        time.sleep(0.001)


@pytest.fixture
def device() -> FakeDevice:
    return FakeDevice()


@pytest.fixture
def handoff(device: FakeDevice) -> Iterator[Handoff]:
    made = device.calls()
    yield made
    device.gate.set()
    made.close()


@needs_cc
class TestCalls:
    def test_made_in_order_on_the_thread(self, device: FakeDevice, handoff: Handoff) -> None:
        s = slot(1)
        assert handoff.hand_off(s, BEFORE, AFTER)
        assert s.handoff
        wait_settled(handoff, s)
        assert device.log == [
            ("launch", BEFORE, STREAM + 1),
            ("submit", DEVICE, TASK + 1, 1, STREAM + 1, 0),
            ("launch", AFTER, STREAM + 1),
        ]
        assert device.threads and threading.get_ident() not in device.threads
        assert not s.handoff and s.handoff_failure is None
        assert handoff.counts()["handed"] == 1

    def test_not_settled_until_the_calls_are_made(
        self, device: FakeDevice, handoff: Handoff
    ) -> None:
        """What the poller relies on: an event not recorded again reads complete."""
        device.gate.clear()
        s = slot()
        handoff.hand_off(s, BEFORE, AFTER)
        time.sleep(0.05)
        assert not handoff.settled(s)
        assert s.handoff
        device.gate.set()
        wait_settled(handoff, s)
        assert len(device.log) == 3

    def test_slots_are_made_in_the_order_handed(self, device: FakeDevice, handoff: Handoff) -> None:
        device.gate.clear()
        slots = [slot(n) for n in (2, 0, 3, 1)]
        for s in slots:
            assert handoff.hand_off(s, BEFORE, AFTER)
        device.gate.set()
        for s in slots:
            wait_settled(handoff, s)
        submitted = [entry[4] for entry in device.log if entry[0] == "submit"]
        assert submitted == [STREAM + n for n in (2, 0, 3, 1)]

    def test_a_slot_handed_twice_at_once_is_a_bug(
        self, device: FakeDevice, handoff: Handoff
    ) -> None:
        device.gate.clear()
        s = slot()
        handoff.hand_off(s, BEFORE, AFTER)
        with pytest.raises(RuntimeError, match="could not be handed"):
            handoff.hand_off(s, BEFORE, AFTER)
        device.gate.set()
        wait_settled(handoff, s)
        assert len(device.log) == 3  # the first hand-off's calls, once

    def test_a_slot_out_of_range_is_a_bug(self, handoff: Handoff) -> None:
        with pytest.raises(RuntimeError, match="could not be handed"):
            handoff.hand_off(slot(4), BEFORE, AFTER)


@needs_cc
class TestFailures:
    @pytest.mark.parametrize("made", [1, 2, 3], ids=["before", "submit", "after"])
    def test_a_failed_call_stops_the_rest_and_marks_the_end(
        self, device: FakeDevice, handoff: Handoff, made: int
    ) -> None:
        device.fail_at[made] = 719
        s = slot()
        handoff.hand_off(s, BEFORE, AFTER)
        wait_settled(handoff, s)
        assert [entry[0] for entry in device.log] == [
            *["launch", "submit", "launch"][:made],
            "record",
        ]
        assert device.log[-1] == ("record", EVENT, STREAM)
        error, retired = s.handoff_failure
        assert retired
        assert str(error) == f"call {made} failed: 719"

    def test_a_failed_end_mark_loses_the_slot(self, device: FakeDevice, handoff: Handoff) -> None:
        device.fail_at.update({2: 3, 3: 1})  # the submit, then the end mark
        s = slot()
        handoff.hand_off(s, BEFORE, AFTER)
        wait_settled(handoff, s)
        error, retired = s.handoff_failure
        assert not retired
        assert str(error) == "call 2 failed: 3"

    def test_the_next_hand_off_of_a_failed_slot_starts_clean(
        self, device: FakeDevice, handoff: Handoff
    ) -> None:
        device.fail_at[2] = 3
        s = slot()
        handoff.hand_off(s, BEFORE, AFTER)
        wait_settled(handoff, s)
        assert s.handoff_failure is not None
        s.handoff_failure = None
        handoff.hand_off(s, BEFORE, AFTER)
        wait_settled(handoff, s)
        assert s.handoff_failure is None

    def test_a_python_runtime_that_cannot_bind_says_why(self) -> None:
        from aiodla.runtime import EmulatedRuntime
        from aiodla.runtime._handoff_calls import python_calls

        runtime = EmulatedRuntime()
        runtime.fail_call("make_current", 3)  # cudaErrorInitializationError
        with pytest.raises(HandoffUnavailableError, match="make_current failed"):
            Handoff(python_calls(runtime), 2)

    def test_a_thread_that_cannot_bind_is_refused(self, device: FakeDevice) -> None:
        device.bind_status = 201
        with pytest.raises(HandoffUnavailableError, match="could not make the device current"):
            device.calls()


@needs_cc
class TestWakeUps:
    def test_a_quiet_engine_makes_its_calls_itself(self, device: FakeDevice) -> None:
        handoff = device.calls(quiet=10.0)
        try:
            time.sleep(0.05)  # the thread is asleep by now
            first, second = slot(0), slot(1)
            assert not handoff.hand_off(first, BEFORE, AFTER)
            assert not first.handoff
            assert handoff.hand_off(second, BEFORE, AFTER)  # the next, at once: handed
            wait_settled(handoff, second)
            assert handoff.counts() == {"handed": 1, "declined": 1, "wakeups": 1}
        finally:
            handoff.close()

    def test_with_no_quiet_spell_everything_is_handed(self, device: FakeDevice) -> None:
        handoff = device.calls(quiet=0.0)
        try:
            time.sleep(0.05)
            s = slot()
            assert handoff.hand_off(s, BEFORE, AFTER)
            wait_settled(handoff, s)
            assert handoff.counts()["declined"] == 0
        finally:
            handoff.close()


@needs_cc
class TestClose:
    def test_close_makes_what_is_queued_first(self, device: FakeDevice) -> None:
        handoff = device.calls()
        device.gate.clear()
        for number in range(4):
            handoff.hand_off(slot(number), BEFORE, AFTER)
        threading.Timer(0.05, device.gate.set).start()
        handoff.close()
        assert len(device.log) == 12

    def test_close_twice_and_hand_off_after(self, device: FakeDevice) -> None:
        handoff = device.calls()
        handoff.close()
        handoff.close()
        s = slot()
        assert not handoff.hand_off(s, BEFORE, AFTER)
        assert handoff.counts() == {"handed": 0, "declined": 0, "wakeups": 0}
        assert device.log == []


class TestLibrary:
    @pytest.fixture
    def fresh(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
        monkeypatch.setattr(_library, "_loaded", {})
        monkeypatch.setenv("AIODLA_CACHE_DIR", str(tmp_path))
        return tmp_path

    @needs_cc
    def test_built_once_then_cached(self, fresh: Path) -> None:
        library = _library.load()
        (built,) = fresh.glob("libaiodla-handoff-*.so")
        assert library.path == built
        stamp = built.stat().st_mtime_ns
        _library._loaded.clear()
        assert _library.load().path == built
        assert built.stat().st_mtime_ns == stamp
        assert [p.name for p in fresh.iterdir()] == [built.name]  # no scratch left

    @needs_cc
    def test_another_compiler_builds_anew(
        self, fresh: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _library.load()
        monkeypatch.setenv("AIODLA_CC", "cc -O1")
        _library.load()
        assert len(list(fresh.glob("libaiodla-handoff-*.so"))) == 2

    def test_no_compiler_says_so(self, fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("AIODLA_CC", "/nonexistent/cc")
        with pytest.raises(HandoffUnavailableError, match="no C compiler '/nonexistent/cc'"):
            _library.load()

    @needs_cc
    def test_a_failed_build_says_why(self, fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("AIODLA_CC", "cc -DAIODLA_HANDOFF_ABI=x -Werror")
        with pytest.raises(HandoffUnavailableError, match=r"failed \(exit \d+\)"):
            _library.load()
        assert list(fresh.glob("*.so")) == []

    @needs_cc
    def test_an_unwritable_cache_says_where(
        self, fresh: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        blocker = fresh / "file"
        blocker.write_text("")
        monkeypatch.setenv("AIODLA_CACHE_DIR", str(blocker / "below"))
        with pytest.raises(HandoffUnavailableError, match="below"):
            _library.load()

    def test_the_cache_follows_xdg(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.delenv("AIODLA_CACHE_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        assert _library.cache_dir() == tmp_path / "aiodla"


class TestDriverFailures:
    """How a failed driver or cuDLA call on the thread reads (the GPU runs them)."""

    def test_a_submit_reads_as_cudla_s_status(self) -> None:
        from aiodla.runtime._handoff_calls import _driver_failure
        from aiodla.runtime._protocol import cudla_status

        assert cudla_status(_driver_failure(2, 4, STREAM)) == 4  # cudlaErrorInvalidAddress

    def test_a_launch_reads_as_a_cuda_error_sticky_or_not(self) -> None:
        from aiodla.runtime._handoff_calls import _driver_failure
        from aiodla.runtime._protocol import CudaCallError

        lost = _driver_failure(3, 719, STREAM)
        assert isinstance(lost, CudaCallError) and lost.sticky
        assert lost.call == "cuGraphLaunch"
        refused = _driver_failure(1, 2, STREAM)
        assert isinstance(refused, CudaCallError) and not refused.sticky
        assert _driver_failure(0, 201, STREAM).call == "cuCtxSetCurrent"  # type: ignore[attr-defined]

    def test_none_over_a_fake_driver(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from aiodla.runtime import _cuda

        monkeypatch.setattr(_cuda, "_rt", object())
        assert _cuda.CudaRuntime().handoff_calls() is None
