"""Build and load the GPU stand-in ``libcudla.so.1``, and drive its test controls.

The stand-in is a *test double* for NVIDIA's cuDLA library: aiodla ships its C/CUDA
source (``aiodla/emulator/standin/``), and :func:`build_standin` compiles it with
``nvcc``. Loaded with :func:`load_standin` before ``cuda.bindings.cudla`` first looks
for libcudla, it serves the real CUDA runtime path on any NVIDIA GPU: tasks of emulator
loadables run as kernels on the caller's streams, the service time spent on the GPU.

Build it once with one command::

    python -m aiodla.emulator.standin_build OUTDIR      # prints OUTDIR/libcudla.so.1

How loading works: ``cuda.bindings.cudla`` resolves each entry point with
``dlsym(RTLD_DEFAULT, ...)`` first, and only then asks ``cuda.pathfinder``, which in turn
returns any library already loaded under the SONAME ``libcudla.so.1``
(``dlopen("libcudla.so.1", RTLD_NOLOAD)``, which matches a loaded object's SONAME even
when it was opened by path and ``RTLD_LOCAL``). Loading the stand-in with
``RTLD_GLOBAL`` satisfies both. The flip side: once any library with that SONAME is in
a process, that process's cuDLA is the stand-in; aiodla's own CPU tests load the real
build only in subprocesses, and the CPU-only ``host_fake`` build under another SONAME.

The C runtime is linked statically (``-cudart static``): the library then needs no
``libcudart.so`` on the loader path, loads (for its host-only helpers) on machines with
no GPU at all, and cannot clash with the CUDA runtime that ``cuda.bindings.runtime``
carries. Sharing streams and events with that other runtime is sound because both are
driver handles of the device's primary context, which every runtime-API user shares.
The archive's own symbols are kept out of the export table by a version script, so the
stand-in cannot interpose on another library's ``cudaMalloc``.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .._entry_points import cudla_entry
from .._errors import ConfigurationError

__all__ = [
    "CONTROL_FUNCTIONS",
    "CUDLA_ENTRY_POINTS",
    "SONAME",
    "StandinControls",
    "StandinGate",
    "build_standin",
    "load_standin",
    "loaded_standins",
    "standin_loaded",
    "standin_source_dir",
]

SONAME = "libcudla.so.1"
HOST_FAKE_NAME = "libcudla-hostfake.so.1"
CUDLA_ENTRY_POINTS = (
    "cudlaGetVersion",
    "cudlaDeviceGetCount",
    "cudlaCreateDevice",
    "cudlaMemRegister",
    "cudlaModuleLoadFromMemory",
    "cudlaModuleGetAttributes",
    "cudlaModuleUnload",
    "cudlaSubmitTask",
    "cudlaDeviceGetAttribute",
    "cudlaMemUnregister",
    "cudlaGetLastError",
    "cudlaDestroyDevice",
    "cudlaSetTaskTimeoutInMs",
)
CONTROL_FUNCTIONS = (
    "aiodlaStandinAbiVersion",
    "aiodlaStandinIsHostFake",
    "aiodlaStandinCores",
    "aiodlaStandinFailNextTask",
    "aiodlaStandinFailNextCall",
    "aiodlaStandinHangCore",
    "aiodlaStandinHoldCore",
    "aiodlaStandinHeldTasks",
    "aiodlaStandinCoreTasks",
    "aiodlaStandinCoreBusyNs",
    "aiodlaStandinLiveHandles",
    "aiodlaStandinLiveResources",
    "aiodlaStandinReleasedByDestroy",
    "aiodlaStandinContextError",
    "aiodlaStandinShutdown",
    "aiodlaStandinCheckLoadable",
    "aiodlaStandinRunOnHost",
    "aiodlaStandinFakeAlloc",
    "aiodlaStandinFakeFree",
)
# 2: aiodlaStandinLiveResources, aiodlaStandinReleasedByDestroy; 3: the on_stream
# argument of aiodlaStandinFailNextTask, aiodlaStandinContextError
ABI_VERSION = 3
_SOURCES = ("standin.cu", "cudla_abi.h", "loadable.h", "task_math.h")
_ENGINE_TIMEOUT = 0x40000006
_DLA_INVALID_INPUT = 0x40000001


def standin_source_dir() -> Path:
    """The directory holding the stand-in's C/CUDA source (package data)."""
    return Path(str(resources.files("aiodla.emulator").joinpath("standin")))


def _arch_flags(arch: str | None) -> list[str]:
    if arch is None:
        detected = _detect_compute_capability()
        if detected is None:
            # nvcc's default target embeds PTX too, which the driver JIT-compiles for
            # newer GPUs: slower to load once, but it runs anywhere.
            return []
        major, minor = detected
        return [
            "-gencode",
            f"arch=compute_{major}{minor},code=[sm_{major}{minor},compute_{major}{minor}]",
        ]
    value = arch.strip()
    if value in ("native", "all", "all-major"):
        return [f"-arch={value}"]
    digits = value.removeprefix("sm_").removeprefix("compute_")
    if not digits.isdigit():
        raise ConfigurationError(
            f"{arch=} must be like 'sm_90', '90', 'native', 'all' or 'all-major'"
        )
    return ["-gencode", f"arch=compute_{digits},code=[sm_{digits},compute_{digits}]"]


def _detect_compute_capability() -> tuple[int, int] | None:
    """The compute capability of CUDA device 0, or None when there is no usable GPU."""
    try:
        from cuda.bindings import runtime as rt

        err, count = rt.cudaGetDeviceCount()
        if int(err) != 0 or count < 1:
            return None
        major_attr = rt.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor
        minor_attr = rt.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor
        err, major = rt.cudaDeviceGetAttribute(major_attr, 0)
        if int(err) != 0:
            return None
        err, minor = rt.cudaDeviceGetAttribute(minor_attr, 0)
        if int(err) != 0:
            return None
        return int(major), int(minor)
    except Exception:  # a broken or absent CUDA install: build for nvcc's default target
        return None


def build_command(
    output: Path, *, nvcc: str = "nvcc", arch: str | None = None, host_fake: bool = False
) -> list[str]:
    """The nvcc command line :func:`build_standin` runs (after writing the export map)."""
    source = standin_source_dir() / "standin.cu"
    soname = HOST_FAKE_NAME if host_fake else SONAME
    command = [
        nvcc,
        "-shared",
        "-std=c++17",
        "-O2",
        "-cudart",
        "static",
        # -fvisibility=hidden keeps our internals private; -ffp-contract=off keeps the
        # host copy of the task arithmetic free of fused multiply-adds, as the kernel is.
        "-Xcompiler",
        "-fPIC,-fvisibility=hidden,-ffp-contract=off",
        "-Xlinker",
        f"-soname={soname}",
        "-Xlinker",
        f"--version-script={output.parent / (output.name + '.map')}",
        "-I",
        str(source.parent),
        "-o",
        str(output),
        str(source),
    ]
    if host_fake:
        command[1:1] = ["-DAIODLA_STANDIN_HOST_FAKE"]
    return command + _arch_flags(arch)


def build_standin(
    output_dir: str | os.PathLike[str],
    *,
    nvcc: str = "nvcc",
    arch: str | None = None,
    host_fake: bool = False,
) -> Path:
    """Compile the stand-in into ``output_dir/libcudla.so.1`` and return its path.

    ``nvcc``: the compiler to run. ``arch``: the GPU target (``"sm_90"``, ``"90"``,
    ``"native"``...); by default the compute capability of CUDA device 0 when there is
    one, else nvcc's default (PTX that the driver compiles on first load).
    ``host_fake=True`` builds the CPU-only variant ``libcudla-hostfake.so.1`` used by
    aiodla's own tests on machines without a GPU: it runs each task on the calling
    host thread over memory from ``aiodlaStandinFakeAlloc``, and serves no GPU.

    Raises ``FileNotFoundError`` when nvcc is missing and ``RuntimeError`` (with the
    compiler's output) when the build fails.
    """
    compiler = shutil.which(nvcc)
    if compiler is None:
        raise FileNotFoundError(f"the CUDA compiler {nvcc!r} was not found on PATH")
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    output = directory / (HOST_FAKE_NAME if host_fake else SONAME)
    # Export the cuDLA ABI and our controls only; everything the static CUDA runtime
    # and libstdc++ templates bring along stays local to the library.
    (directory / (output.name + ".map")).write_text(
        "{\n  global:\n    cudla*;\n    aiodlaStandin*;\n  local:\n    *;\n};\n"
    )
    command = build_command(output, nvcc=compiler, arch=arch, host_fake=host_fake)
    partial = output.with_name(output.name + ".partial")
    command[command.index(str(output))] = str(partial)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"building the cuDLA stand-in failed (exit {result.returncode}):\n"
            f"{' '.join(command)}\n{result.stdout}{result.stderr}"
        )
    # Renamed into place so a process that has the old file loaded keeps its mapping.
    os.replace(partial, output)
    return output


_loaded: dict[Path, StandinControls] = {}
_load_lock = threading.Lock()


def load_standin(path: str | os.PathLike[str]) -> StandinControls:
    """Load the stand-in so ``cuda.bindings.cudla`` uses it; return its controls.

    Call it before anything in the process calls into ``cuda.bindings.cudla`` (once it
    has bound to a libcudla, the bindings keep it). Loading the same file again
    returns the same controls. Raises ``RuntimeError`` when another ``libcudla.so.1``
    is already loaded, or when the bindings turn out to be bound to a different one.
    """
    resolved = Path(path).resolve()
    with _load_lock:
        if resolved in _loaded:
            return _loaded[resolved]
        other = _already_loaded_cudla()
        if other is not None and not hasattr(other, "aiodlaStandinAbiVersion"):
            raise RuntimeError(
                "another libcudla.so.1 is already loaded in this process; load the "
                "stand-in before anything uses cuda.bindings.cudla"
            )
        library = ctypes.CDLL(str(resolved), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        controls = StandinControls(library)
        _check_bindings_use(library)
        _loaded[resolved] = controls
        atexit.register(controls.shutdown)
        return controls


def _already_loaded_cudla() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(SONAME, mode=os.RTLD_NOW | getattr(os, "RTLD_NOLOAD", 4))
    except OSError:
        return None


def _check_bindings_use(library: ctypes.CDLL) -> None:
    """Make sure ``cuda.bindings.cudla`` finds its entry points in this library: where
    the bindings look (the process's global scope, then the library ``cuda.pathfinder``
    located), the stand-in's ``cudlaGetVersion`` must be the one found."""
    mine = ctypes.cast(library.cudlaGetVersion, ctypes.c_void_p).value
    found = cudla_entry("cudlaGetVersion", _VERSION_CALL)
    theirs = None if found is None else ctypes.cast(found, ctypes.c_void_p).value
    if theirs and mine != theirs:
        raise RuntimeError(
            "cuda.bindings.cudla is bound to another libcudla.so.1; load the stand-in "
            "before the first cuDLA call in the process"
        )


_VERSION_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


def loaded_standins() -> dict[Path, StandinControls]:
    """The stand-in libraries this process loaded, by path, with their controls (a
    worker process of ``isolation="process"`` loads the one its application did)."""
    with _load_lock:
        return dict(_loaded)


def standin_loaded() -> bool:
    """True when the libcudla.so.1 of this process is aiodla's stand-in."""
    library = _already_loaded_cudla()
    return library is not None and hasattr(library, "aiodlaStandinAbiVersion")


class StandinGate:
    """A held core of the stand-in: its next task waits on the GPU before it starts.

    A core starts one task at a time, so at most one task waits at the gate; the
    core's other tasks queue behind it on the GPU. A held task also ends, failing with
    ``ERROR_DLA_ERR_ENGINE_TIMEOUT``, when it has waited for its device's task timeout.
    """

    def __init__(self, controls: StandinControls, core: int) -> None:
        self._controls = controls
        self.core = core

    @property
    def held(self) -> int:
        """Tasks waiting at the gate now (0 or 1)."""
        return self._controls.held_tasks(self.core)

    def wait_for_held(self, count: int = 1, timeout: float = 10.0) -> bool:
        """Block until ``count`` tasks (at most 1) wait at the gate; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.held < min(count, 1):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def release(self) -> None:
        """Let the held task and every later task of the core run."""
        self._controls.release(self.core)

    def __enter__(self) -> StandinGate:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class StandinControls:
    """The stand-in's fault injection and accounting, with the emulated runtime's meaning.

    Statuses are ``cudlaStatus`` values; cores are DLA core indexes.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self._bind()
        version = int(library.aiodlaStandinAbiVersion())
        if version != ABI_VERSION:
            raise RuntimeError(
                f"the stand-in library speaks control ABI {version}, this aiodla {ABI_VERSION}; "
                "rebuild it with this aiodla's build_standin"
            )

    def _bind(self) -> None:
        lib = self.library
        u64, u32, c_int = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int
        signatures: dict[str, tuple[Any, list[Any]]] = {
            "aiodlaStandinAbiVersion": (u32, []),
            "aiodlaStandinIsHostFake": (u32, []),
            "aiodlaStandinCores": (u64, []),
            "aiodlaStandinFailNextTask": (c_int, [u64, u32, u32]),
            "aiodlaStandinFailNextCall": (c_int, [ctypes.c_char_p, u32]),
            "aiodlaStandinHangCore": (c_int, [u64, c_int]),
            "aiodlaStandinHoldCore": (c_int, [u64, c_int]),
            "aiodlaStandinHeldTasks": (c_int, [u64]),
            "aiodlaStandinCoreTasks": (u64, [u64]),
            "aiodlaStandinCoreBusyNs": (u64, [u64]),
            "aiodlaStandinLiveHandles": (
                None,
                [ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u64)],
            ),
            "aiodlaStandinLiveResources": (None, [ctypes.POINTER(u64)] * 4),
            "aiodlaStandinReleasedByDestroy": (None, [ctypes.POINTER(u64)] * 2),
            "aiodlaStandinContextError": (c_int, []),
            "aiodlaStandinShutdown": (None, []),
            "aiodlaStandinCheckLoadable": (
                c_int,
                [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t],
            ),
            "aiodlaStandinRunOnHost": (
                c_int,
                [
                    ctypes.c_void_p,
                    ctypes.c_size_t,
                    ctypes.POINTER(ctypes.c_void_p),
                    ctypes.POINTER(ctypes.c_void_p),
                ],
            ),
            "aiodlaStandinFakeAlloc": (ctypes.c_void_p, [ctypes.c_size_t]),
            "aiodlaStandinFakeFree": (c_int, [ctypes.c_void_p]),
        }
        for name, (restype, argtypes) in signatures.items():
            function = getattr(lib, name)
            function.restype = restype
            function.argtypes = argtypes

    # -- facts -------------------------------------------------------------------------

    @property
    def cores(self) -> int:
        """DLA cores the stand-in reports (2, or ``AIODLA_STANDIN_CORES``)."""
        return int(self.library.aiodlaStandinCores())

    @property
    def host_fake(self) -> bool:
        """True for the CPU-only test build (tasks run on the submitting thread)."""
        return bool(self.library.aiodlaStandinIsHostFake())

    def _core(self, core: int) -> int:
        if not isinstance(core, int) or not 0 <= core < self.cores:
            raise ConfigurationError(f"{core=} is not one of the {self.cores} cores")
        return core

    @staticmethod
    def _ok(call: str, status: int) -> None:
        if status != 0:
            from cuda.bindings import cudla

            try:
                raise cudla.CudlaError(status)
            except ValueError:  # a status outside cudla.Status
                raise RuntimeError(f"{call} failed with status {status}") from None

    # -- faults ------------------------------------------------------------------------

    def fail_next_task(
        self, core: int, status: int = _DLA_INVALID_INPUT, *, on_stream: bool = False
    ) -> None:
        """The next task to start on ``core`` fails with ``status`` (a cudlaStatus); its
        outputs are not written. The same call as ``EmulatedRuntime.fail_next_task``.

        By default the failure shows only through ``get_last_error``. ``on_stream=True``
        makes it surface as a DLA hardware fault does in hybrid mode (NVIDIA's
        cuDLAErrorReporting sample): a sticky CUDA error on the task's stream, which
        loses the process's CUDA context, while ``get_last_error`` still reports the
        status. A GPU cannot raise ``cudaErrorExternalDevice`` as the DLA does, so the
        task's kernel traps once it has published its status: every later CUDA call
        then fails with the trap's error, ``cudaErrorLaunchFailure`` (719) or, on some
        drivers and GPUs, ``cudaErrorIllegalInstruction`` (715), both sticky
        (``CudaCallError.sticky``: the engine dies). Use it in a process of its own:
        the context is not found again. :attr:`context_error` says which error it was.
        """
        from cuda.bindings import cudla

        code = int(cudla.Status(int(status)))
        if code == 0:
            raise ConfigurationError("status=0 is success, not a failure")
        self._ok(
            "fail_next_task",
            self.library.aiodlaStandinFailNextTask(self._core(core), code, int(bool(on_stream))),
        )

    def fail_next_call(self, function: str, status: int) -> None:
        """The next call of the entry point ``function`` returns ``status`` and does nothing.

        ``status`` may be any 32-bit value, including codes ``cudla.Status`` lacks.
        """
        if function not in CUDLA_ENTRY_POINTS:
            raise ConfigurationError(f"{function=} is not one of {CUDLA_ENTRY_POINTS}")
        self._ok(
            "fail_next_call",
            self.library.aiodlaStandinFailNextCall(function.encode(), int(status) & 0xFFFFFFFF),
        )

    def hang_core(self, core: int, hung: bool = True) -> None:
        """Tasks starting on ``core`` run until their device's task timeout, then fail
        with ``ERROR_DLA_ERR_ENGINE_TIMEOUT``; ``hung=False`` ends that for later tasks."""
        self._ok("hang_core", self.library.aiodlaStandinHangCore(self._core(core), int(hung)))

    def hold(self, core: int) -> StandinGate:
        """Hold the tasks of ``core`` on the GPU before they start, until released."""
        self._ok("hold", self.library.aiodlaStandinHoldCore(self._core(core), 1))
        return StandinGate(self, core)

    def release(self, core: int) -> None:
        """Release a held core."""
        self._ok("release", self.library.aiodlaStandinHoldCore(self._core(core), 0))

    def held_tasks(self, core: int) -> int:
        """Tasks waiting at ``core``'s gate now (0 or 1)."""
        return int(self.library.aiodlaStandinHeldTasks(self._core(core)))

    def shutdown(self) -> None:
        """End every gate and hang at once (registered to run at interpreter exit)."""
        self.library.aiodlaStandinShutdown()

    # -- accounting --------------------------------------------------------------------

    def core_tasks(self, core: int) -> int:
        """Tasks completed on ``core`` since the library was loaded."""
        return int(self.library.aiodlaStandinCoreTasks(self._core(core)))

    def core_busy_time(self, core: int) -> float:
        """Seconds of service time ``core``'s completed tasks took."""
        return int(self.library.aiodlaStandinCoreBusyNs(self._core(core))) / 1e9

    def live_handles(self) -> dict[str, int]:
        """Live device handles, modules and registrations (all zero after a clean close)."""
        counts = [ctypes.c_uint64() for _ in range(3)]
        self.library.aiodlaStandinLiveHandles(*(ctypes.byref(c) for c in counts))
        devices, modules, registrations = (int(c.value) for c in counts)
        return {"devices": devices, "modules": modules, "registrations": registrations}

    def live_resources(self) -> dict[str, int]:
        """What the stand-in holds of the CUDA device now: its live device allocations
        (``allocations``, ``bytes``), CUDA ``events`` and ``streams``. All zero once every
        device handle is destroyed; the per-process control block is not counted."""
        counts = [ctypes.c_uint64() for _ in range(4)]
        self.library.aiodlaStandinLiveResources(*(ctypes.byref(c) for c in counts))
        allocations, nbytes, events, streams = (int(c.value) for c in counts)
        return {"allocations": allocations, "bytes": nbytes, "events": events, "streams": streams}

    @property
    def context_error(self) -> int:
        """The sticky ``cudaError_t`` that lost the process's CUDA context, 0 while the
        context is whole (as far as the stand-in's own calls and live streams tell).
        Once lost, cuDLA handles can still be released: the work queued behind the
        fault is gone with the context. Host-fake builds report ``cudaErrorLaunchFailure``
        (719) once a task failed with ``on_stream=True``."""
        return int(self.library.aiodlaStandinContextError())

    def released_by_destroy(self) -> dict[str, int]:
        """Modules and registrations that ``cudlaDestroyDevice`` released because the
        caller had not, since the library was loaded. cuDLA lets destroy end what the
        handle owns; zero for a caller that unregisters and unloads in order itself."""
        counts = [ctypes.c_uint64() for _ in range(2)]
        self.library.aiodlaStandinReleasedByDestroy(*(ctypes.byref(c) for c in counts))
        modules, registrations = (int(c.value) for c in counts)
        return {"modules": modules, "registrations": registrations}

    # -- host-side helpers (no GPU needed) ---------------------------------------------

    def check_loadable(self, data: bytes) -> tuple[int, str]:
        """Run the stand-in's loadable parser: (cudlaStatus, reason when rejected)."""
        message = ctypes.create_string_buffer(256)
        blob = bytes(data)
        status = self.library.aiodlaStandinCheckLoadable(blob, len(blob), message, len(message))
        return int(status), message.value.decode("ascii", "replace")

    def run_on_host(
        self,
        loadable: bytes,
        inputs: Sequence[np.ndarray[Any, Any]],
        outputs: Sequence[np.ndarray[Any, Any]],
    ) -> int:
        """One task of ``loadable`` with the kernel's element code, on the CPU.

        ``inputs`` / ``outputs``: contiguous uint8 arrays of at least each tensor's
        size; outputs are overwritten. Returns the cudlaStatus (0 on success).
        """
        arrays = [*inputs, *outputs]
        for array in arrays:
            if not (isinstance(array, np.ndarray) and array.flags.c_contiguous):
                raise TypeError("inputs and outputs must be C-contiguous numpy arrays")
        for array in outputs:
            if not array.flags.writeable:
                raise ValueError("output arrays must be writable")
        pointer_array = ctypes.c_void_p * max(len(inputs), 1)
        in_ptrs = pointer_array(*(a.ctypes.data for a in inputs))
        out_ptrs = (ctypes.c_void_p * max(len(outputs), 1))(*(a.ctypes.data for a in outputs))
        blob = bytes(loadable)
        return int(self.library.aiodlaStandinRunOnHost(blob, len(blob), in_ptrs, out_ptrs))

    def fake_alloc(self, nbytes: int) -> int:
        """Host-fake builds: "device memory" the fake's cudlaMemRegister accepts."""
        if not self.host_fake:
            raise RuntimeError("fake_alloc exists only in the host-fake build")
        pointer = self.library.aiodlaStandinFakeAlloc(nbytes)
        if not pointer:
            raise MemoryError(f"fake_alloc({nbytes}) failed")
        return int(pointer)

    def fake_free(self, pointer: int) -> None:
        """Host-fake builds: free what :meth:`fake_alloc` returned."""
        self._ok("fake_free", self.library.aiodlaStandinFakeFree(pointer))
