"""CudaRuntime's hot path through the calls that keep the GIL (``_gil_held``), without a
GPU: what each driver or cuDLA status becomes, and when the bindings are asked instead.

The real entry points run in tests/runtime/test_cuda_unit.py (cudlaSubmitTask of the
host-fake stand-in) and in tests/gpu (all three, on a GPU).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest
from cuda.bindings import cudla
from cuda.bindings import runtime as rt

import aiodla.runtime._cuda as cuda_module
from aiodla import _entry_points
from aiodla.runtime import _gil_held
from aiodla.runtime._cuda import CudaRuntime, UnknownCudlaStatusError
from aiodla.runtime._cuda_graphs import CudaGraph
from aiodla.runtime._gil_held import EntryPoints
from aiodla.runtime._protocol import CudaCallError

_NOT_READY = 600
_LAUNCH_FAILURE = 719


class _Bindings:
    """The two runtime calls the hot path may fall back to, answering as told."""

    def __init__(self) -> None:
        self.query_error = rt.cudaError_t.cudaSuccess
        self.launch_error = rt.cudaError_t.cudaSuccess
        self.calls: list[str] = []

    def cudaEventQuery(self, event: int) -> tuple[Any]:
        self.calls.append(f"query {event}")
        return (self.query_error,)

    def cudaGraphLaunch(self, executable: Any, stream: int) -> tuple[Any]:
        self.calls.append(f"launch {executable} {stream}")
        return (self.launch_error,)


class _Entry:
    """A held entry point: answers ``status`` and remembers its arguments."""

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, *args: int) -> int:
        self.calls.append(args)
        return self.status


def _not_through_the_bindings(*args: Any) -> None:
    """Stands for a bindings' cuDLA call that a held entry point replaces."""
    raise AssertionError("the held entry point answered: the bindings must not be called")


@pytest.fixture
def bindings(monkeypatch: pytest.MonkeyPatch) -> _Bindings:
    fake = _Bindings()
    monkeypatch.setattr(cuda_module, "_rt", fake)
    return fake


class TestSubmit:
    @pytest.fixture
    def runtime(self, monkeypatch: pytest.MonkeyPatch) -> CudaRuntime:
        monkeypatch.setattr(cudla, "submit_task", _not_through_the_bindings)
        return CudaRuntime()

    def test_success_passes_the_task_once(self, runtime: CudaRuntime) -> None:
        entry = _Entry()
        runtime._held = EntryPoints(submit_task=entry)
        task = runtime.make_task(11, [32], [64])
        runtime.submit_task(5, task, 9)
        assert entry.calls == [(5, task.ptr, 1, 9, 0)]

    def test_a_known_status_raises_what_the_bindings_raise(self, runtime: CudaRuntime) -> None:
        # By value: cuda-bindings 13.3 and 13.5 spell the members' names differently.
        invalid_address = cudla.Status(4)
        runtime._held = EntryPoints(submit_task=_Entry(int(invalid_address)))
        with pytest.raises(cudla.CudlaError) as caught:
            runtime.submit_task(5, runtime.make_task(11, [32], [64]), 9)
        assert caught.value.status == invalid_address
        assert not isinstance(caught.value, UnknownCudlaStatusError)

    def test_a_status_outside_the_enum_is_named(self, runtime: CudaRuntime) -> None:
        runtime._held = EntryPoints(submit_task=_Entry(4242))
        with pytest.raises(UnknownCudlaStatusError) as caught:
            runtime.submit_task(5, runtime.make_task(11, [32], [64]), 9)
        assert (caught.value.status, caught.value.call) == (4242, "cudlaSubmitTask")


class TestQuery:
    def test_done_and_running_need_no_binding_call(self, bindings: _Bindings) -> None:
        runtime = CudaRuntime()
        runtime._held = EntryPoints(event_query=_Entry(0))
        assert runtime.query_event(3) is True
        runtime._held = EntryPoints(event_query=_Entry(_NOT_READY))
        assert runtime.query_event(3) is False
        assert bindings.calls == []

    def test_an_error_is_asked_again_and_named_by_the_bindings(self, bindings: _Bindings) -> None:
        runtime = CudaRuntime()
        runtime._held = EntryPoints(event_query=_Entry(_LAUNCH_FAILURE))
        bindings.query_error = rt.cudaError_t.cudaErrorLaunchFailure
        with pytest.raises(CudaCallError) as caught:
            runtime.query_event(3)
        assert (caught.value.call, caught.value.name) == (
            "cudaEventQuery",
            "cudaErrorLaunchFailure",
        )
        assert caught.value.sticky
        assert bindings.calls == ["query 3"]

    def test_the_bindings_answer_wins(self, bindings: _Bindings) -> None:
        runtime = CudaRuntime()
        runtime._held = EntryPoints(event_query=_Entry(_LAUNCH_FAILURE))
        assert runtime.query_event(3) is True  # the bindings found it done


class TestLaunch:
    def _graph(self) -> CudaGraph:
        return CudaGraph("executable", (("copies_to_device", 1),), address=77)

    def test_a_held_launch_counts_once_and_skips_the_bindings(self, bindings: _Bindings) -> None:
        runtime = CudaRuntime()
        entry = _Entry(0)
        runtime.use_entry_points(EntryPoints(graph_launch=entry))
        runtime.launch_graph(self._graph(), 7)
        assert entry.calls == [(77, 7)]
        assert bindings.calls == []
        assert runtime.counts.copies_to_device == 1

    def test_a_failed_launch_is_made_once_through_the_bindings(self, bindings: _Bindings) -> None:
        runtime = CudaRuntime()
        # e.g. out of memory for the launch, then not
        runtime.use_entry_points(EntryPoints(graph_launch=_Entry(2)))
        runtime.launch_graph(self._graph(), 7)
        assert bindings.calls == ["launch executable 7"]
        assert runtime.counts.copies_to_device == 1

    def test_a_launch_failing_both_ways_names_the_runtime_error(self, bindings: _Bindings) -> None:
        runtime = CudaRuntime()
        runtime.use_entry_points(EntryPoints(graph_launch=_Entry(_LAUNCH_FAILURE)))
        bindings.launch_error = rt.cudaError_t.cudaErrorLaunchFailure
        with pytest.raises(CudaCallError, match="cudaGraphLaunch") as caught:
            runtime.launch_graph(self._graph(), 7)
        assert caught.value.sticky
        assert runtime.counts.copies_to_device == 0  # nothing ran


class TestStatus:
    def test_read_through_the_held_entry_point(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(cudla, "get_last_error", _not_through_the_bindings)
        runtime = CudaRuntime()
        entry = _Entry(0x40000006)
        runtime._held = EntryPoints(last_error=entry)
        assert runtime.get_last_error(5) == 0x40000006
        assert entry.calls == [(5,)]


class TestFindingTheEntryPoints:
    @pytest.fixture
    def library(self, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
        """The bindings' cuDLA entry points and a driver library, as fakes."""
        found: dict[str, Any] = {"cudla": [], "driver": object()}

        def cudla_entry(name: str, prototype: Any) -> _Entry:
            found["cudla"].append(name)
            return _Entry()

        monkeypatch.setattr(_gil_held, "cudla_entry", cudla_entry)
        monkeypatch.setattr(_gil_held, "loaded", lambda soname: found["driver"])
        monkeypatch.setattr(_gil_held, "driver_entry", lambda name, prototype: name)
        monkeypatch.setattr(cudla, "create_device", lambda core, mode: 1000 + core)
        monkeypatch.setattr(CudaRuntime, "make_current", lambda self: None)
        return found

    def test_found_with_the_first_device(self, library: dict[str, Any]) -> None:
        runtime = CudaRuntime()
        assert not any(runtime._held)  # creating the runtime calls nothing
        assert runtime.create_device(1) == 1001
        assert library["cudla"] == ["cudlaSubmitTask", "cudlaGetLastError"]
        assert isinstance(runtime._held.submit_task, _Entry)
        assert isinstance(runtime._held.last_error, _Entry)
        assert (runtime._held.graph_launch, runtime._held.event_query) == (
            "cuGraphLaunch",
            "cuEventQuery",
        )
        runtime.create_device(0)
        assert len(library["cudla"]) == 2  # once

    def test_not_when_told_not_to(self, library: dict[str, Any]) -> None:
        runtime = CudaRuntime(hold_gil=False)
        runtime.create_device(0)
        assert not any(runtime._held)
        assert library["cudla"] == []

    def test_no_driver_calls_over_replaced_bindings(
        self, library: dict[str, Any], bindings: _Bindings
    ) -> None:
        # The GPU tests' host fake replaces the runtime bindings: its handles are not the
        # driver's, so only cuDLA's calls (the same library either way) are held.
        runtime = CudaRuntime()
        runtime.create_device(0)
        assert isinstance(runtime._held.submit_task, _Entry)
        assert (runtime._held.graph_launch, runtime._held.event_query) == (None, None)

    def test_no_driver_loaded(self, library: dict[str, Any]) -> None:
        library["driver"] = None
        held = _gil_held.entry_points(driver=True)
        assert (held.graph_launch, held.event_query) == (None, None)


def test_nothing_is_found_before_the_libraries_are_loaded() -> None:
    # This process never loaded a driver (no GPU in CI); the lookup must not load one.
    if _gil_held.loaded("libcuda.so.1") is not None:
        pytest.skip("a CUDA driver is loaded in this process")
    held = _gil_held.entry_points(driver=True)
    assert (held.graph_launch, held.event_query) == (None, None)
    assert _gil_held.loaded("libcuda.so.1") is None


class TestPublicLookups:
    """The entry points come through public interfaces: the process's global scope and
    the library cuda.pathfinder located (cuDLA's), and cuGetProcAddress (the driver's)."""

    def test_cudla_entry_from_the_global_scope(self) -> None:
        # Any symbol of the global scope stands for an RTLD_GLOBAL libcudla's.
        entry = _gil_held.cudla_entry("getpid", ctypes.PYFUNCTYPE(ctypes.c_int))
        assert entry is not None and entry() == os.getpid()
        assert _gil_held.cudla_entry("cudlaNoSuchCall", _gil_held.SUBMIT) is None

    def test_cudla_library_is_the_one_pathfinder_located(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import cuda.pathfinder

        libc = _loaded_path("libc.so")
        asked: list[str] = []

        def locate(name: str) -> Any:
            asked.append(name)
            return cuda.pathfinder.LoadedDL(libc, True, 0, "was-already-loaded")

        monkeypatch.setattr(_entry_points, "_CUDLA", "libc.so.6")  # loaded, as libcudla would be
        monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", locate)
        library = _gil_held.cudla_library()
        assert asked == ["cudla"]
        assert library is not None and library._name == libc

    def test_no_cudla_library_is_loaded_by_the_lookup(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import cuda.pathfinder

        def locate(name: str) -> Any:
            raise AssertionError("pathfinder asked although no libcudla is loaded")

        monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", locate)
        if _gil_held.loaded("libcudla.so.1") is not None:
            pytest.skip("a libcudla.so.1 is loaded in this process")
        assert _gil_held.cudla_library() is None

    def test_driver_entry_through_cu_get_proc_address(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from cuda.bindings import driver

        getpid = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
        asked: list[tuple[Any, ...]] = []

        def get_proc_address(symbol: bytes, version: int, flags: Any) -> tuple[Any, ...]:
            asked.append((symbol, version, flags))
            return (driver.CUresult.CUDA_SUCCESS, getpid, 0)

        monkeypatch.setattr(driver, "cuGetProcAddress", get_proc_address)
        entry = _gil_held.driver_entry("cuEventQuery", ctypes.PYFUNCTYPE(ctypes.c_int))
        assert entry is not None and entry() == os.getpid()
        legacy = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
        assert asked == [(b"cuEventQuery", 12000, legacy)]

    @pytest.mark.parametrize("answer", ["error", "null", "raises"])
    def test_driver_entry_none_where_the_driver_has_none(
        self, monkeypatch: pytest.MonkeyPatch, answer: str
    ) -> None:
        from cuda.bindings import driver

        def get_proc_address(symbol: bytes, version: int, flags: Any) -> tuple[Any, ...]:
            if answer == "raises":
                raise RuntimeError("no driver")
            if answer == "error":
                return (driver.CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0)
            return (driver.CUresult.CUDA_SUCCESS, 0, 0)

        monkeypatch.setattr(driver, "cuGetProcAddress", get_proc_address)
        assert _gil_held.driver_entry("cuGraphLaunch", _gil_held._LAUNCH) is None


def _loaded_path(prefix: str) -> str:
    """The path of a library this process has loaded (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(prefix):
                return path
    pytest.skip(f"no {prefix} in /proc/self/maps")


def test_the_prototypes_keep_the_gil() -> None:
    python_api = ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
    for prototype in (
        _gil_held.SUBMIT,
        _gil_held._LAST_ERROR,
        _gil_held._LAUNCH,
        _gil_held._QUERY,
    ):
        assert prototype._flags_ & python_api
