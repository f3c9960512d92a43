"""Layout conversion on the GPU: NVRTC kernels that pack logical arrays into DLA buffers
and unpack them, byte for byte what ``TensorSpec.pack`` / ``unpack`` (numpy) give.

One program per engine holds a kernel per (tensor, source dtype) and (tensor, result
dtype) pair, each specialized for its tensor (shape, strides, lanes and scale are
compile-time constants; see :mod:`aiodla.runtime._conversion_source`). It is compiled
at open and cached on disk, keyed by a hash of the source, the options, the GPU
architecture and the NVRTC version. Launches go straight to ``cuLaunchKernel`` with a
prebuilt grid and a per-thread parameter block: the request path launches one kernel
per input and per output, so each launch costs a few microseconds of Python only.

Device rules beyond numpy's: NaN packed into an integer tensor becomes 0 (the host
refuses NaN there before packing, see ``TensorSpec.check_array``); the calling thread
must have the device's primary context current, as for every CUDA call of the engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from .._errors import RuntimeUnavailableError
from ._cache import EntryRefused, cache_dir, cache_folder, read_entry, write_entry
from ._conversion_source import BLOCK, KernelPlan, plan_program
from ._protocol import CudaCallError

if TYPE_CHECKING:
    from .._tensors import TensorSpec

__all__ = ["ConversionKernels", "kernel_cache_dir", "kernel_source"]

# Bump when the cache file's framing or the program's meaning changes without its text.
_CACHE_FORMAT = b"aiodla-kernels-1"
_OPTIONS: dict[str, Any] = {
    # IEEE behaviour everywhere: no flush-to-zero (float16 subnormals), no contraction.
    "std": "c++17",
    "ftz": False,
    "prec_div": True,
    "prec_sqrt": True,
    "fma": False,
}
_PARAMS = struct.Struct("<6q")  # (src, dst, sn, sc, sh, sw): every kernel argument is 8 bytes


def kernel_source(
    packs: Sequence[tuple[TensorSpec, Any]], unpacks: Sequence[tuple[TensorSpec, Any]]
) -> str:
    """The CUDA C++ source of the program for these pairs (no GPU needed)."""
    return plan_program(packs, unpacks).source


def kernel_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where compiled programs are cached: ``kernels`` in aiodla's cache directory
    (``$AIODLA_CACHE_DIR``, else ``$XDG_CACHE_HOME/aiodla``, else ``~/.cache/aiodla``)."""
    return cache_dir(environ) / "kernels"


class _Toolchain(Protocol):
    """What compiling and launching need from CUDA; swapped for a fake in CPU tests."""

    def target(self) -> tuple[str, str]:
        """(GPU architecture such as ``sm_90``, NVRTC version) of the device."""

    def compile(self, source: str, arch: str) -> bytes:
        """A cubin; raises RuntimeUnavailableError with NVRTC's log when it fails."""

    def load(self, cubin: bytes, names: Sequence[str]) -> dict[str, Any]:
        """Launchable handles of the named kernels; raises on an unusable cubin."""


def _import_core() -> Any:
    """cuda.core (1.x), or its experimental namespace (0.x)."""
    try:
        import cuda.core as core

        if hasattr(core, "Program"):
            return core
    except ImportError:
        pass
    try:
        import cuda.core.experimental as experimental
    except ImportError as exc:
        raise RuntimeUnavailableError(
            "GPU layout conversion needs NVIDIA's cuda.core (pip install cuda-core) to "
            f"compile its kernels with NVRTC: {exc}"
        ) from None
    return experimental


class _CudaCore:
    """The real toolchain: cuda.core's Program (NVRTC) and ObjectCode."""

    def __init__(self, device: int) -> None:
        self.core = _import_core()
        try:
            self.device = self.core.Device(device)
            self.device.set_current()
        except Exception as exc:
            raise RuntimeUnavailableError(f"CUDA device {device} is not usable: {exc}") from exc

    def target(self) -> tuple[str, str]:
        major, minor = self.device.compute_capability
        try:
            from cuda.bindings import nvrtc

            error, nv_major, nv_minor = nvrtc.nvrtcVersion()
        except Exception as exc:  # libnvrtc absent: the bindings raise on first use
            raise RuntimeUnavailableError(
                "GPU layout conversion needs NVRTC (libnvrtc; pip install "
                f"nvidia-cuda-nvrtc or the CUDA toolkit): {exc}"
            ) from None
        if int(error) != 0:
            raise RuntimeUnavailableError(f"NVRTC is not usable here: nvrtcVersion gave {error}")
        return f"sm_{major}{minor}", f"{nv_major}.{nv_minor}"

    def compile(self, source: str, arch: str) -> bytes:
        log = _Log()
        try:
            options = self.core.ProgramOptions(arch=arch, name="aiodla_conversion", **_OPTIONS)
            program = self.core.Program(source, "c++", options)
            try:
                code = program.compile("cubin", logs=log)
            finally:
                program.close()
        except Exception as exc:
            raise RuntimeUnavailableError(
                f"NVRTC could not compile aiodla's conversion kernels for {arch}: {exc}"
                + (f"\nNVRTC log:\n{log.text}" if log.text else "")
            ) from None
        return bytes(code.code)

    def load(self, cubin: bytes, names: Sequence[str]) -> dict[str, Any]:
        from cuda.bindings import driver

        object_code = self.core.ObjectCode
        if hasattr(object_code, "from_cubin"):
            code = object_code.from_cubin(cubin)
        else:  # cuda.core 0.1
            code = object_code(cubin, "cubin")
        handles: dict[str, Any] = {}
        for name in names:
            kernel = code.get_kernel(name)
            handle = getattr(kernel, "handle", None) or kernel._handle
            # cuLaunchKernel takes a CUkernel cast to CUfunction (CUDA >= 12.0).
            handles[name] = driver.CUfunction(int(handle))
        # keep the library loaded as long as the handles live
        handles["__object_code__"] = code
        return handles


class _Log:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text


class _Launch(NamedTuple):
    function: Any  # CUfunction
    grid: int


class _PackKernels(NamedTuple):
    vector: _Launch  # 16-byte stores: the destination is 16-byte aligned
    element: _Launch
    source_size: int


class _UnpackKernel(NamedTuple):
    launch: _Launch
    stored_size: int
    result_size: int


class _Params(threading.local):
    """One kernel-parameter block per thread: cuLaunchKernel releases the GIL, so a
    block shared between threads could change under a launch that is reading it.
    ``count`` 8-byte arguments (the pre-processing kernels take more than six)."""

    def __init__(self, count: int = _PARAMS.size // 8) -> None:
        self.values = ctypes.create_string_buffer(8 * count)
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_void_p * count)(*(base + 8 * i for i in range(count)))
        self.address = ctypes.addressof(self.pointers)


_Launcher = Callable[..., tuple[Any, ...]]


class ConversionKernels:
    """The compiled conversion kernels of one engine's tensors, launched on CUDA streams."""

    def __init__(
        self,
        packs: dict[tuple[TensorSpec, np.dtype[Any]], _PackKernels],
        unpacks: dict[tuple[TensorSpec, np.dtype[Any]], _UnpackKernel],
        *,
        from_cache: bool,
        keep_alive: Any = None,
        launcher: _Launcher | None = None,
    ) -> None:
        self._packs = packs
        self._unpacks = unpacks
        self._from_cache = from_cache
        self._keep_alive = keep_alive
        # (id(spec), dtype) -> (spec, kernels): identity first, as the engine passes the
        # same spec objects every request and hashing a dataclass costs microseconds.
        self._pack_ids: dict[tuple[int, Any], tuple[TensorSpec, _PackKernels]] = {}
        self._unpack_ids: dict[tuple[int, Any], tuple[TensorSpec, _UnpackKernel]] = {}
        self._params = _Params()
        self._launcher = launcher or default_launcher()

    @classmethod
    def compile(
        cls,
        packs: Sequence[tuple[TensorSpec, np.dtype[Any]]],
        unpacks: Sequence[tuple[TensorSpec, np.dtype[Any]]],
        *,
        device: int = 0,
        cache_dir: Path | None = None,
    ) -> ConversionKernels:
        """Compile (or take from the disk cache) every kernel the pairs need, in one
        NVRTC program. Raises RuntimeUnavailableError when cuda.core, NVRTC or the
        device is missing or the compile fails (with NVRTC's log)."""
        program = plan_program(packs, unpacks)
        names = [plan.name for plans in program.packs.values() for plan in plans]
        names += [plan.name for plan in program.unpacks.values()]
        handles, from_cache = build_program(
            program.source, names, device=device, cache_dir=cache_dir, what="conversion"
        )

        def launch(plan: KernelPlan) -> _Launch:
            return _Launch(handles[plan.name], plan.grid)

        pack_kernels = {
            pair: _PackKernels(launch(vector), launch(element), pair[1].itemsize)
            for pair, (vector, element) in program.packs.items()
        }
        unpack_kernels = {
            pair: _UnpackKernel(launch(plan), pair[0].numpy_dtype.itemsize, pair[1].itemsize)
            for pair, plan in program.unpacks.items()
        }
        return cls(pack_kernels, unpack_kernels, from_cache=from_cache, keep_alive=handles)

    @property
    def compiled_from_cache(self) -> bool:
        """True when the program came from the disk cache, not from NVRTC."""
        return self._from_cache

    def pack(
        self,
        spec: TensorSpec,
        source: np.dtype[Any],
        src_ptr: int,
        src_strides: tuple[int, int, int, int],
        dst_ptr: int,
        stream: int,
    ) -> None:
        """Enqueue on ``stream`` the packing of the logical (n, c, h, w) array at
        ``src_ptr`` (element strides ``src_strides``, any sign) into the DLA buffer at
        ``dst_ptr``: every one of ``spec.size`` bytes is written, as ``spec.pack``."""
        found = self._pack_ids.get((id(spec), source))
        if found is None or found[0] is not spec:
            found = self._pack_ids[(id(spec), source)] = (spec, self._find_pack(spec, source))
        kernels = found[1]
        sn, sc, sh, sw = src_strides
        if src_ptr % kernels.source_size:
            raise ValueError(f"tensor {spec.name!r}: source pointer {src_ptr:#x} is unaligned")
        if dst_ptr & 15:
            kernel = kernels.element
            if dst_ptr % spec.numpy_dtype.itemsize:
                raise ValueError(f"tensor {spec.name!r}: buffer pointer {dst_ptr:#x} is unaligned")
        else:
            kernel = kernels.vector
        params = self._params
        _PARAMS.pack_into(params.values, 0, src_ptr, dst_ptr, sn, sc, sh, sw)
        self._launch("pack", kernel, stream, params.address)

    def unpack(
        self, spec: TensorSpec, result: np.dtype[Any], src_ptr: int, dst_ptr: int, stream: int
    ) -> None:
        """Enqueue on ``stream`` the unpacking of the DLA buffer at ``src_ptr`` into a
        dense logical NCHW array of ``result`` at ``dst_ptr``, as ``spec.unpack(raw,
        dtype=result)`` gives (``result`` == the stored dtype: no dequantization)."""
        found = self._unpack_ids.get((id(spec), result))
        if found is None or found[0] is not spec:
            found = self._unpack_ids[(id(spec), result)] = (spec, self._find_unpack(spec, result))
        kernel = found[1]
        if src_ptr % kernel.stored_size or dst_ptr % kernel.result_size:
            raise ValueError(
                f"tensor {spec.name!r}: unaligned pointer (buffer {src_ptr:#x}, "
                f"result {dst_ptr:#x})"
            )
        params = self._params
        _PARAMS.pack_into(params.values, 0, src_ptr, dst_ptr, 0, 0, 0, 0)
        self._launch("unpack", kernel.launch, stream, params.address)

    def _launch(self, what: str, kernel: _Launch, stream: int, params: int) -> None:
        launch_kernel(self._launcher, what, kernel, stream, params)

    def _find_pack(self, spec: TensorSpec, source: Any) -> _PackKernels:
        kernels = self._packs.get((spec, np.dtype(source)))
        if kernels is None:
            raise ValueError(
                f"no pack kernel was compiled for tensor {spec.name!r} from {np.dtype(source)} "
                f"arrays (compiled: {_pairs(self._packs)})"
            )
        return kernels

    def _find_unpack(self, spec: TensorSpec, result: Any) -> _UnpackKernel:
        kernel = self._unpacks.get((spec, np.dtype(result)))
        if kernel is None:
            raise ValueError(
                f"no unpack kernel was compiled for tensor {spec.name!r} into "
                f"{np.dtype(result)} (compiled: {_pairs(self._unpacks)})"
            )
        return kernel

    def __repr__(self) -> str:
        origin = "cache" if self._from_cache else "nvrtc"
        return (
            f"<ConversionKernels [{len(self._packs)} pack, {len(self._unpacks)} unpack, "
            f"from {origin}]>"
        )


def _pairs(table: Mapping[tuple[TensorSpec, np.dtype[Any]], Any]) -> str:
    return ", ".join(f"{spec.name}/{dtype}" for spec, dtype in table) or "none"


def default_launcher() -> _Launcher:
    """The driver's cuLaunchKernel (imported on first use: it needs libcuda)."""
    from cuda.bindings import driver

    return driver.cuLaunchKernel  # type: ignore[no-any-return]


def _toolchain(device: int) -> _Toolchain:
    return _CudaCore(device)


def build_program(
    source: str, names: Sequence[str], *, device: int, cache_dir: Path | None, what: str
) -> tuple[dict[str, Any], bool]:
    """The named kernels of ``source``, loaded: from the disk cache, keyed by the source,
    the options, the architecture and the NVRTC version, else compiled and cached. Also
    whether the cache served them. Raises RuntimeUnavailableError as ``compile`` says."""
    toolchain = _toolchain(device)
    arch, nvrtc_version = toolchain.target()
    key = hashlib.sha256(
        b"\0".join(
            [
                _CACHE_FORMAT,
                source.encode(),
                repr(sorted(_OPTIONS.items())).encode(),
                arch.encode(),
                nvrtc_version.encode(),
            ]
        )
    ).hexdigest()
    # A folder or entry that may not be trusted is not read: the program is compiled
    # and kept in memory only (see _cache).
    folder = cache_folder(kernel_cache_dir() if cache_dir is None else Path(cache_dir))
    path = None if folder is None else folder / f"{key}.cubin"
    handles: dict[str, Any] | None = None
    try:
        cubin = None if path is None else read_entry(path)
    except EntryRefused:
        cubin, path = None, None
    from_cache = cubin is not None
    if cubin is not None:
        try:
            handles = toolchain.load(cubin, names)
        except Exception:  # an entry that passed its checksum yet will not load
            handles, from_cache = None, False
    if handles is None:
        cubin = toolchain.compile(source, arch)
        try:
            handles = toolchain.load(cubin, names)
        except Exception as exc:
            raise RuntimeUnavailableError(
                f"the {what} kernels compiled for {arch} could not be loaded: {exc}"
            ) from exc
        if path is not None:
            write_entry(path, cubin)
    return handles, from_cache


class CompiledKernels:
    """What every program of aiodla's kernels holds once compiled (or taken from the
    cache) by :func:`build_program`: its loaded module, kept alive as long as its
    handles, whether the cache served it, and the launcher (``cuLaunchKernel``; the
    CPU tests' host build). The pre-processing and detector kernels build on it."""

    what = "GPU"  # the kernels' name in errors: "cuLaunchKernel (pre-processing)"

    def __init__(
        self, *, from_cache: bool, keep_alive: Any = None, launcher: _Launcher | None = None
    ) -> None:
        self._from_cache = from_cache
        self._keep_alive = keep_alive
        self._launcher = launcher or default_launcher()

    @classmethod
    def build(
        cls, source: str, names: Sequence[str], *, device: int, cache_dir: Path | None
    ) -> tuple[dict[str, Any], bool]:
        """:func:`build_program` of ``source``, its errors naming these kernels."""
        return build_program(source, names, device=device, cache_dir=cache_dir, what=cls.what)

    @property
    def compiled_from_cache(self) -> bool:
        """True when the program came from the disk cache, not from NVRTC."""
        return self._from_cache

    def _launch(self, kernel: _Launch, stream: int, params: int) -> None:
        launch_kernel(self._launcher, self.what, kernel, stream, params)

    def _describe(self) -> str:
        return ""

    def __repr__(self) -> str:
        origin = "cache" if self._from_cache else "nvrtc"
        return f"<{type(self).__name__} [{self._describe()}, from {origin}]>"


def launch_kernel(
    launcher: _Launcher, what: str, kernel: _Launch, stream: int, params: int
) -> None:
    """cuLaunchKernel of ``kernel`` (BLOCK threads a block) on ``stream`` with the
    parameter block at ``params``; CudaCallError when the launch fails."""
    (error,) = launcher(kernel.function, kernel.grid, 1, 1, BLOCK, 1, 1, 0, stream, params, 0)
    if error:
        code = int(error)
        # The driver's codes equal the runtime's cudaError_t values for every error
        # a launch can report, the sticky ones included (700, 719, ...).
        raise CudaCallError(f"cuLaunchKernel ({what})", code, getattr(error, "name", None))
