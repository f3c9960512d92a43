"""The checks of ``aiodla doctor`` (see ``_doctor``): each reads what :class:`Host`
gives it, or the CUDA probe's facts, and returns one :class:`Finding`; none raises for a
missing piece, and none waits on a tool longer than the host's timeout.
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .runtime._cache import unsafe
from .runtime._conversion_kernels import kernel_cache_dir

__all__ = [
    "FAIL",
    "OK",
    "STATUSES",
    "WARN",
    "Finding",
    "Host",
    "Platform",
    "bindings_check",
    "cache_check",
    "clocks_check",
    "cores_check",
    "cuda_check",
    "cuda_version",
    "cudla_check",
    "cudla_version",
    "files_check",
    "memfd_check",
    "nvrtc_check",
    "platform_check",
    "power_check",
    "said",
    "video_decoders_check",
]

OK, WARN, FAIL = "ok", "warn", "fail"
STATUSES = (OK, WARN, FAIL)

#: cuda.bindings.cudla first shipped in cuda-bindings 13.3.
MIN_BINDINGS = (13, 3)
#: Below this soft limit of open files, many engines and worker processes run short.
MIN_OPEN_FILES = 1024

# L4T major release -> JetPack major release (NVIDIA's JetPack archive).
# Jetson modules without a DLA: the engine cannot use one there.
_NO_DLA = ("Orin Nano", "Jetson Nano", "TX1", "TX2")


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one check found: its status, the finding in words, and for warn and fail
    the fix in one line."""

    status: str
    detail: str
    fix: str | None = None


def _open_files() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _try_memfd() -> None:
    # What isolation="process" does first: an anonymous shared file, sized (sparse).
    fd = os.memfd_create("aiodla-doctor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 16 << 20)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class Host:
    """Where the checks look: the file system root, the PATH for NVIDIA's tools, the
    environment, the timeout of every subprocess, and the CUDA probe's command."""

    root: Path = Path("/")
    path: str | None = None  # None: $PATH
    environ: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(os.environ))
    timeout: float = 30.0
    probe_command: Sequence[str] = (sys.executable, "-m", "aiodla._doctor_probe")
    open_files: Callable[[], tuple[int, int]] = _open_files
    memfd: Callable[[], None] = _try_memfd

    def file(self, relative: str) -> Path:
        return self.root / relative

    def run(self, command: Sequence[str]) -> tuple[int, str, str]:
        """(exit status, stdout, stderr); raises subprocess.TimeoutExpired or OSError."""
        done = subprocess.run(
            list(command),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=self.timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        return done.returncode, done.stdout, done.stderr


@dataclasses.dataclass(frozen=True)
class Platform:
    jetson: bool
    module: str | None
    l4t: str | None
    jetpack: str | None


def said(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def cuda_version(value: Any) -> str | None:
    if not isinstance(value, int) or value <= 0:
        return None
    return f"{value // 1000}.{value % 1000 // 10}"


def cudla_version(value: Any) -> str | None:
    if not isinstance(value, int) or value <= 0:
        return None
    # cuDLA packs its version as major * 1_000_000 + minor * 1_000 + patch.
    return f"{value // 1_000_000}.{value // 1_000 % 1_000}.{value % 1_000}"


# -- the checks ---------------------------------------------------------


def platform_check(where: Platform, unread: Sequence[str] = ()) -> Finding:
    """The platform; ``unread``: its files that are there but could not be read (not a
    regular file, too large, no permission), which leave the answer uncertain."""
    if unread:
        return Finding(
            WARN,
            f"{'a Jetson' if where.jetson else 'not a Jetson'} as far as could be read; "
            f"not read: {'; '.join(unread)}",
            "these must be regular files of a few bytes: replace them, or point --root at "
            "another tree",
        )
    if not where.jetson:
        # The one line that says so: the checks of what only a Jetson has are ok here.
        return Finding(
            WARN,
            "not a Jetson: the emulated runtime will be used (emulator loadables only)",
            "run DLA loadables on a Jetson with a DLA (AGX Orin, Orin NX); here, test with "
            "emulator loadables ('aiodla emulate')",
        )
    module = where.module or "a Jetson (no model in the device tree)"
    release = (
        f"L4T {where.l4t}" + (f" (JetPack {where.jetpack})" if where.jetpack else "")
        if where.l4t
        else "L4T release unknown"
    )
    if any(name in module for name in _NO_DLA):
        return Finding(
            FAIL,
            f"{module}, {release}: this module has no DLA",
            "the DLA is on Jetson AGX Orin, Orin NX and Xavier; run this model on the GPU "
            "with TensorRT here",
        )
    if where.l4t is None:
        return Finding(
            WARN,
            f"{module}; no L4T release in /etc/nv_tegra_release",
            "install JetPack (nvidia-l4t-core writes /etc/nv_tegra_release)",
        )
    return Finding(OK, f"{module}, {release}")


def _unknown(facts: Mapping[str, Any], key: str) -> str | None:
    """Why ``key`` is not known: the whole probe failed, or this fact's read did."""
    if "probe_error" in facts:
        return str(facts["probe_error"])
    error = facts.get(f"{key}_error")
    return None if error is None else str(error)


def cudla_check(facts: Mapping[str, Any], need: str, jetson: bool) -> Finding:
    library = facts.get("cudla_library")
    if isinstance(library, str):
        version = cudla_version(facts.get("cudla_version")) or "unknown version"
        if facts.get("standin"):
            return Finding(
                OK, f"aiodla's GPU stand-in {library} ({version}): a test double, no DLA"
            )
        return Finding(OK, f"{library}, cuDLA {version}")
    why = _unknown(facts, "cudla_library") or "not found"
    if not jetson:
        return Finding(OK, "not a Jetson: no libcudla.so.1, none needed (emulated runtime)")
    return Finding(
        need,
        f"libcudla.so.1 cannot be loaded: {why}",
        "install JetPack's CUDA (sudo apt install nvidia-jetpack) and make "
        "/usr/local/cuda/lib64 visible (LD_LIBRARY_PATH or ldconfig)",
    )


def cores_check(facts: Mapping[str, Any], need: str, jetson: bool) -> Finding:
    cores = facts.get("dla_cores")
    if isinstance(cores, int) and cores > 0:
        return Finding(OK, f"cuDLA reports {cores} DLA core{'s' if cores != 1 else ''}")
    if "cudla_library" not in facts and not jetson:
        return Finding(OK, "not a Jetson: the emulated runtime gives 2 emulated cores")
    why = (
        "cuDLA reports no DLA cores"
        if cores == 0
        else f"unknown: {_unknown(facts, 'dla_cores') or 'cuDLA is not loaded'}"
    )
    return Finding(
        need,
        why,
        "check that the DLA is enabled in the device tree and that this user may open "
        "/dev/nvhost-* (the video and render groups)",
    )


def cuda_check(facts: Mapping[str, Any], need: str, jetson: bool) -> Finding:
    driver = cuda_version(facts.get("driver_version"))
    runtime = cuda_version(facts.get("runtime_version"))
    if driver is None and not jetson and "probe_error" not in facts:
        return Finding(OK, "not a Jetson: no CUDA driver, none needed (emulated runtime)")
    if driver is None:
        why = _unknown(facts, "driver_version") or "no CUDA driver"
        fix = (
            "the CUDA driver comes with L4T: reinstall nvidia-l4t-cuda or reflash"
            if jetson
            else "cuDLA hybrid mode needs a CUDA driver; the emulated runtime needs none"
        )
        return Finding(need, f"driver: {why}; runtime {runtime or 'unknown'}", fix)
    devices = facts.get("cuda_devices")
    found = f", {devices} device(s)" if isinstance(devices, int) else ""
    text = f"driver {driver}, runtime {runtime or 'unknown'}{found}"
    if runtime is not None and _as_tuple(runtime) > _as_tuple(driver):
        return Finding(
            need,
            f"{text}: the runtime is newer than the driver",
            "install the CUDA forward-compatibility package or a JetPack whose driver is "
            f"at least {runtime}",
        )
    return Finding(OK, text)


def _as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def bindings_check(facts: Mapping[str, Any]) -> Finding:
    version = facts.get("bindings_version")
    if not isinstance(version, str):
        why = _unknown(facts, "bindings_version") or "not installed"
        return Finding(FAIL, f"cuda-bindings: {why}", "pip install 'cuda-bindings>=13.3'")
    if _as_tuple(version)[:2] < MIN_BINDINGS:
        return Finding(
            FAIL,
            f"{version}: cuda.bindings.cudla first shipped in 13.3",
            "pip install -U 'cuda-bindings>=13.3'",
        )
    spelling = facts.get("status_spelling")
    if not isinstance(spelling, str):
        why = _unknown(facts, "status_spelling") or "unknown"
        return Finding(
            FAIL,
            f"{version}, but cuda.bindings.cudla cannot be imported: {why}",
            "reinstall: pip install --force-reinstall 'cuda-bindings>=13.3'",
        )
    era = "13.5 and later" if spelling.isupper() else "13.3 and 13.4"
    return Finding(OK, f"{version}; cudla.Status spells {spelling} ({era})")


def nvrtc_check(facts: Mapping[str, Any], jetson: bool = True) -> Finding:
    version = facts.get("nvrtc_version")
    if isinstance(version, str):
        where = facts.get("nvrtc_library")
        return Finding(
            OK,
            f"NVRTC {version}{f' ({where})' if isinstance(where, str) else ''}: layout "
            "conversion can run as GPU kernels",
        )
    why = _unknown(facts, "nvrtc_version") or "not found"
    if not jetson and cuda_version(facts.get("driver_version")) is None:
        return Finding(OK, f"no NVRTC ({why}); none needed without a GPU")
    return Finding(
        WARN,
        f"no NVRTC ({why}): layout conversion runs on the host's CPU",
        "pip install 'nvidia-cuda-nvrtc>=13.0' (or JetPack's CUDA provides it)",
    )


def cache_check(host: Host) -> Finding:
    directory = kernel_cache_dir(host.environ)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    reason = unsafe(os.lstat(existing), "directory") if existing == directory else None
    if reason is not None:
        return Finding(
            WARN,
            f"{directory} is refused ({reason}): conversion kernels compile at every open",
            f"make it yours and private (chmod 700 {directory}), or set AIODLA_CACHE_DIR",
        )
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        state = "writable" if existing == directory else f"can be created (in {existing})"
        return Finding(OK, f"{directory} {state}")
    return Finding(
        WARN,
        f"{directory} is not writable: conversion kernels compile at every open",
        "set AIODLA_CACHE_DIR to a writable directory",
    )


def _tool(host: Host, name: str, args: Sequence[str]) -> tuple[str | None, Finding | None]:
    """The tool's stdout, or the warning that says why there is none."""
    found = shutil.which(
        name, path=host.path if host.path is not None else host.environ.get("PATH")
    )
    if found is None:
        return None, Finding(
            WARN,
            f"{name} not found on PATH: cannot tell",
            f"{name} ships with L4T (/usr/sbin or /usr/bin); run as a user whose PATH has it",
        )
    command = " ".join([name, *args])
    try:
        status, out, err = host.run([found, *args])
    except subprocess.TimeoutExpired:
        return None, Finding(
            WARN,
            f"'{command}' did not answer within {host.timeout:g} s",
            f"run '{command}' by hand to see why it hangs",
        )
    except OSError as exc:
        return None, Finding(WARN, f"'{command}' cannot run: {said(exc)}", f"check {found}")
    if status != 0:
        first = (err.strip() or out.strip()).splitlines()[:1] or ["no message"]
        root = "root" in first[0].lower() or "permission" in first[0].lower()
        fix = f"sudo aiodla doctor (or sudo {command})" if root else f"run '{command}' by hand"
        return None, Finding(WARN, f"'{command}' failed (status {status}): {first[0]}", fix)
    return out, None


def power_check(host: Host, jetson: bool) -> Finding:
    if not jetson:
        return Finding(OK, "not a Jetson: no power modes")
    out, problem = _tool(host, "nvpmodel", ["-q"])
    if problem is not None or out is None:
        return problem or Finding(WARN, "no answer", None)
    found = re.search(r"NV Power Mode:\s*(\S+)", out)
    if found is None:
        return Finding(
            WARN,
            f"cannot read the mode from 'nvpmodel -q': {out.strip()[:80]!r}",
            "run 'nvpmodel -q' by hand",
        )
    ident = re.search(r"^\s*(\d+)\s*$", out[found.end() :], re.MULTILINE)
    mode = f"{found[1]}" + (f" (mode {ident[1]})" if ident else "")
    if found[1].upper().startswith("MAXN"):
        return Finding(OK, mode)
    return Finding(
        WARN,
        f"{mode}: the DLA, GPU and memory clocks are capped below MAXN",
        "sudo nvpmodel -m 0 (MAXN on AGX Orin; 'nvpmodel -p --verbose' lists the modes)",
    )


_FREQ = re.compile(r"^(\S+?):?\s.*?MinFreq=(\d+)\s+MaxFreq=(\d+)(.*)$")


def clocks_check(host: Host, jetson: bool) -> Finding:
    if not jetson:
        return Finding(OK, "not a Jetson: no clocks to pin")
    out, problem = _tool(host, "jetson_clocks", ["--show"])
    if problem is not None or out is None:
        return problem or Finding(WARN, "no answer", None)
    domains, loose = 0, []
    for line in out.splitlines():
        found = _FREQ.match(line.strip())
        if found is None:
            continue
        name = found[1]
        if not (name.startswith("cpu") or name in ("GPU", "EMC")):
            continue  # DLA and other engines' lines: jetson_clocks leaves them to nvpmodel
        domains += 1
        # jetson_clocks sets min = max for the CPUs and the GPU, and locks the EMC's
        # rate (FreqOverride=1) without touching its minimum.
        pinned = found[2] == found[3] or "FreqOverride=1" in found[4]
        if not pinned:
            loose.append(name)
    if domains == 0:
        return Finding(
            WARN,
            "cannot read the clocks from 'jetson_clocks --show'",
            "run 'sudo jetson_clocks --show' by hand",
        )
    if loose:
        shown = ", ".join(loose[:4]) + (f" and {len(loose) - 4} more" if len(loose) > 4 else "")
        return Finding(
            WARN,
            f"not pinned ({shown} scale with load): latency will vary",
            "sudo jetson_clocks (undo: sudo jetson_clocks --restore)",
        )
    return Finding(OK, f"pinned ({domains} CPU, GPU and memory clock domains)")


def memfd_check(host: Host) -> Finding:
    try:
        host.memfd()
    except Exception as exc:
        return Finding(
            WARN,
            f"memfd_create failed ({said(exc)}): isolation='process' cannot stage requests",
            "use isolation='thread' (the default), or free memory",
        )
    return Finding(OK, "anonymous shared memory works (isolation='process' stages in it)")


def files_check(host: Host) -> Finding:
    soft, hard = host.open_files()
    shown_hard = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        return Finding(
            WARN,
            f"soft limit {soft} (hard {shown_hard}): many engines or worker processes may run out",
            f"ulimit -n {min(4096, hard) if hard > 0 else 4096}",
        )
    return Finding(OK, f"soft limit {soft} (hard {shown_hard})")


def video_decoders_check() -> Finding:
    """Which of VideoSource's decoders this machine has, and which ``"auto"`` takes
    for a file or stream."""
    from ._video_address import parse_address
    from ._video_decoders import available_decoders, choose_decoder

    found = available_decoders()
    have = [name for name, why in found.items() if why is None]
    lacking = "; ".join(f"{name}: {why}" for name, why in found.items() if why is not None)
    if not have:
        return Finding(
            WARN,
            f"no video decoder ({lacking}): VideoSource cannot read cameras or files",
            "pip install 'aiodla[video]' (FFmpeg through PyAV, everywhere)",
        )
    auto = choose_decoder("auto", parse_address("stream.mp4"))
    detail = f"{', '.join(have)} (auto takes {auto})"
    return Finding(OK, detail + (f"; not here: {lacking}" if lacking else ""))
