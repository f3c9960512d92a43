"""``aiodla doctor``: is this machine ready to run aiodla on its DLA, and if not, why.

Each check gives one line: ``ok``, ``warn`` or ``fail``, what it found, and for warn
and fail the fix in one line. Nothing here raises or waits without bound: the CUDA
stack is asked by a subprocess (``aiodla._doctor_probe``) and ``nvpmodel`` and
``jetson_clocks`` are run, each under a timeout; a piece that is missing, hangs or
crashes is a line saying so. Where the machine is not a Jetson, what only a Jetson has
is a warning (the emulated runtime runs emulator loadables there), not a failure.

Everything the checks read comes through :class:`Host`, so a test gives them a fake
Jetson: a root directory holding ``proc/device-tree/model`` and
``etc/nv_tegra_release``, a PATH with fake ``nvpmodel`` and ``jetson_clocks``, and
its own probe command.

The JSON report (``aiodla doctor --json``) follows :data:`SCHEMA` (JSON Schema,
draft 2020-12)::

    {"schema": "aiodla-doctor/1",
     "ok": true,                       # no check failed (the exit status is 0)
     "platform": {"jetson": true, "module": "...", "l4t": "R36.4.0", "jetpack": "6"},
     "versions": {"aiodla": "...", "python": "...", "cuda_bindings": "13.5.0",
                  "cudla": "1.4.0", "cuda_driver": "12.6", "cuda_runtime": "13.0",
                  "nvrtc": "13.0"},     # null where unknown
     "checks": [{"id": "platform", "title": "platform", "status": "ok",
                 "detail": "...", "fix": null}, ...]}
"""

from __future__ import annotations

import dataclasses
import json
import platform as _platform
import re
import signal
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from . import __version__
from ._doctor_checks import (
    FAIL,
    STATUSES,
    WARN,
    Finding,
    Host,
    Platform,
    bindings_check,
    cache_check,
    clocks_check,
    cores_check,
    cuda_check,
    cuda_version,
    cudla_check,
    cudla_version,
    files_check,
    memfd_check,
    nvrtc_check,
    platform_check,
    power_check,
    said,
    video_decoders_check,
)
from ._safe_paths import read_limited

__all__ = ["SCHEMA", "Check", "Host", "Report", "diagnose"]

# L4T major release -> JetPack major release (NVIDIA's JetPack archive).
_JETPACK = {32: "4", 34: "5", 35: "5", 36: "6", 38: "7"}
_VERSION_KEYS = ("aiodla", "python", "cuda_bindings", "cudla", "cuda_driver", "cuda_runtime")
_NULLABLE_STRING = {"type": ["string", "null"]}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "aiodla doctor report",
    "type": "object",
    "required": ["schema", "ok", "platform", "versions", "checks"],
    "additionalProperties": False,
    "properties": {
        "schema": {"const": "aiodla-doctor/1"},
        "ok": {"type": "boolean", "description": "no check failed"},
        "platform": {
            "type": "object",
            "required": ["jetson", "module", "l4t", "jetpack"],
            "additionalProperties": False,
            "properties": {
                "jetson": {"type": "boolean"},
                "module": _NULLABLE_STRING,
                "l4t": _NULLABLE_STRING,
                "jetpack": _NULLABLE_STRING,
            },
        },
        "versions": {
            "type": "object",
            "required": [*_VERSION_KEYS, "nvrtc"],
            "additionalProperties": False,
            "properties": {key: _NULLABLE_STRING for key in (*_VERSION_KEYS, "nvrtc")},
        },
        "checks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "title", "status", "detail", "fix"],
                "additionalProperties": False,
                "properties": {
                    "id": {"type": "string"},
                    "title": {"type": "string"},
                    "status": {"enum": list(STATUSES)},
                    "detail": {"type": "string"},
                    "fix": {"type": ["string", "null"], "description": "for warn and fail"},
                },
            },
        },
    },
}


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report: a check's name and what it found."""

    id: str
    title: str
    status: str
    detail: str
    fix: str | None = None


@dataclasses.dataclass(frozen=True)
class Report:
    platform: Platform
    versions: dict[str, str | None]
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(check.status != FAIL for check in self.checks)

    def document(self) -> dict[str, Any]:
        """The JSON report, as :data:`SCHEMA` describes it."""
        return {
            "schema": "aiodla-doctor/1",
            "ok": self.ok,
            "platform": dataclasses.asdict(self.platform),
            "versions": dict(self.versions),
            "checks": [dataclasses.asdict(check) for check in self.checks],
        }

    def lines(self) -> list[str]:
        """The report for a person: a line per check, its fix beneath."""
        width = max(len(check.title) for check in self.checks)
        out = []
        for check in self.checks:
            out.append(f"{check.status:<5} {check.title:<{width}}  {check.detail}")
            if check.fix:
                out.append(f"{'':<5} {'':<{width}}  fix: {check.fix}")
        failed = sum(check.status == FAIL for check in self.checks)
        warned = sum(check.status == WARN for check in self.checks)
        out.append(f"{failed} failed, {warned} warning(s): {'ready' if self.ok else 'not ready'}")
        return out


def diagnose(host: Host | None = None) -> Report:
    """Run every check; never raises."""
    host = host or Host()
    where, unread = _read_platform(host)
    facts = _probe(host)
    need = FAIL if where.jetson else WARN
    steps: list[tuple[str, str, Callable[[], Finding]]] = [
        ("platform", "platform", lambda: platform_check(where, unread)),
        ("cudla", "cuDLA", lambda: cudla_check(facts, need, where.jetson)),
        ("dla_cores", "DLA cores", lambda: cores_check(facts, need, where.jetson)),
        ("cuda", "CUDA", lambda: cuda_check(facts, need, where.jetson)),
        ("cuda_bindings", "cuda-bindings", lambda: bindings_check(facts)),
        ("nvrtc", "NVRTC", lambda: nvrtc_check(facts, where.jetson)),
        ("kernel_cache", "kernel cache", lambda: cache_check(host)),
        ("power_mode", "power mode", lambda: power_check(host, where.jetson)),
        ("clocks", "clocks", lambda: clocks_check(host, where.jetson)),
        ("shared_memory", "shared memory", lambda: memfd_check(host)),
        ("open_files", "open files", lambda: files_check(host)),
        ("video_decoders", "video decode", video_decoders_check),
    ]
    checks = []
    for ident, title, step in steps:
        try:
            found = step()
        except Exception as exc:  # a check that breaks is a line, never a traceback
            found = Finding(
                FAIL,
                f"the check itself failed: {said(exc)}",
                "report this as an aiodla bug, with this line",
            )
        checks.append(Check(ident, title, found.status, found.detail, found.fix))
    return Report(where, _versions(facts), tuple(checks))


# -- facts ---------------------------------------------------------------------------


#: The files the platform is read from are a few hundred bytes; more is not one of them.
PLATFORM_FILE_LIMIT = 64 << 10


def _read_text(host: Host, relative: str, unread: list[str]) -> str | None:
    """The file's text, or None where it is absent; a file that is there but is no
    regular file, or is too large, or cannot be read, is named in ``unread``."""
    path = host.file(relative)
    try:
        data = read_limited(path, PLATFORM_FILE_LIMIT)
    except FileNotFoundError:
        return None
    except OSError as exc:
        unread.append(f"{path} ({exc.strerror or said(exc)})")
        return None
    return data.replace(b"\x00", b"").decode(errors="replace").strip()


def _read_platform(host: Host) -> tuple[Platform, list[str]]:
    """The platform, and the files it should come from that are there but were not
    read (see :func:`_read_text`)."""
    unread: list[str] = []
    model = _read_text(host, "proc/device-tree/model", unread)
    compatible = _read_text(host, "proc/device-tree/compatible", unread) or ""
    release = _read_text(host, "etc/nv_tegra_release", unread)
    l4t = jetpack = None
    if release:
        found = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", release)
        if found:
            major = int(found[1])
            l4t, jetpack = f"R{major}.{found[2]}", _JETPACK.get(major)
    jetson = bool(
        release is not None or "nvidia,tegra" in compatible or (model and "Jetson" in model)
    )
    return Platform(jetson, model or None, l4t, jetpack), unread


def _probe(host: Host) -> dict[str, Any]:
    what = "the CUDA probe (python -m aiodla._doctor_probe)"
    try:
        status, out, err = host.run(host.probe_command)
    except subprocess.TimeoutExpired:
        return {"probe_error": f"{what} did not answer within {host.timeout:g} s (a hung driver?)"}
    except OSError as exc:
        return {"probe_error": f"{what} could not start: {said(exc)}"}
    if status != 0:
        if status < 0:
            try:
                name = signal.Signals(-status).name
            except ValueError:
                name = f"signal {-status}"
            cause = f"died of {name}"
        else:
            cause = f"exited with status {status}"
        last = err.strip().splitlines()[-1:] or [""]
        return {"probe_error": f"{what} {cause}: {last[0][:200]}".rstrip(": ")}
    try:
        facts = json.loads(out)
    except ValueError:
        return {"probe_error": f"{what} printed no JSON: {out[:120]!r}"}
    return facts if isinstance(facts, dict) else {"probe_error": f"{what} printed {out[:120]!r}"}


def _versions(facts: Mapping[str, Any]) -> dict[str, str | None]:
    bindings = facts.get("bindings_version")
    nvrtc = facts.get("nvrtc_version")
    return {
        "aiodla": __version__,
        "python": _platform.python_version(),
        "cuda_bindings": bindings if isinstance(bindings, str) else None,
        "cudla": cudla_version(facts.get("cudla_version")),
        "cuda_driver": cuda_version(facts.get("driver_version")),
        "cuda_runtime": cuda_version(facts.get("runtime_version")),
        "nvrtc": nvrtc if isinstance(nvrtc, str) else None,
    }
