"""aiodla doctor: a fake Jetson (a root with a device tree and nv_tegra_release, fake
nvpmodel and jetson_clocks on PATH, a fake CUDA probe), each piece missing in turn."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from aiodla import _cli
from aiodla._doctor import SCHEMA, Host, Report, diagnose

jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (the 'test' extra)")

ORIN = "NVIDIA Jetson AGX Orin Developer Kit"
RELEASE = "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64\n"
READY = {
    "bindings_version": "13.5.0",
    "status_spelling": "ERROR_INVALID_PARAM",
    "cudla_library": "/usr/local/cuda/lib64/libcudla.so.1",
    "standin": False,
    "cudla_version": 1_007_000,
    "dla_cores": 2,
    "driver_version": 12060,
    "runtime_version": 12060,
    "cuda_devices": 1,
    "nvrtc_version": "12.6",
    "nvrtc_library": "/usr/local/cuda/lib64/libnvrtc.so.12",
}
MAXN = "NV Power Mode: MAXN\n0\n"
PINNED = """SOC family:tegra234  Machine:NVIDIA Jetson AGX Orin Developer Kit
Online CPUs: 0-11
cpu0: Online=1 Governor=schedutil MinFreq=2201600 MaxFreq=2201600 CurrentFreq=2201600 IdleStates: WFI=0 c7=0
cpu1: Online=1 Governor=schedutil MinFreq=2201600 MaxFreq=2201600 CurrentFreq=2201600 IdleStates: WFI=0 c7=0
GPU MinFreq=1300500000 MaxFreq=1300500000 CurrentFreq=1300500000
EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=3199000000 FreqOverride=1
DLA0_CORE:   Online=1 MinFreq=0 MaxFreq=1600000000 CurrentFreq=1600000000
"""
LOOSE = PINNED.replace("MinFreq=2201600", "MinFreq=729600").replace(
    "FreqOverride=1", "FreqOverride=0"
)


def script(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def printing(text: str, status: int = 0) -> str:
    return f"cat <<'EOF'\n{text}EOF\nexit {status}"


class FakeJetson:
    """A root, a PATH and a probe; each part can be taken away or changed."""

    def __init__(self, base: Path) -> None:
        self.root = base / "root"
        self.bin = base / "bin"
        (self.root / "proc/device-tree").mkdir(parents=True)
        (self.root / "etc").mkdir()
        self.bin.mkdir()
        self.cache = base / "cache"
        self.model(ORIN)
        (self.root / "etc/nv_tegra_release").write_text(RELEASE)
        self.nvpmodel(printing(MAXN))
        self.jetson_clocks(printing(PINNED))
        self.facts: dict[str, Any] = dict(READY)
        self.probe: list[str] | None = None
        self.timeout = 10.0
        self.open_files: Callable[[], tuple[int, int]] = lambda: (4096, 4096)
        self.memfd: Callable[[], None] = lambda: None

    def model(self, text: str) -> None:
        (self.root / "proc/device-tree/model").write_bytes(text.encode() + b"\x00")

    def nvpmodel(self, body: str) -> None:
        script(self.bin, "nvpmodel", body)

    def jetson_clocks(self, body: str) -> None:
        script(self.bin, "jetson_clocks", body)

    def host(self) -> Host:
        probe = self.probe or [sys.executable, "-c", f"print({json.dumps(self.facts)!r})"]
        return Host(
            root=self.root,
            path=str(self.bin),
            environ={"AIODLA_CACHE_DIR": str(self.cache)},
            timeout=self.timeout,
            probe_command=probe,
            open_files=self.open_files,
            memfd=self.memfd,
        )

    def diagnose(self) -> Report:
        report = diagnose(self.host())
        jsonschema.validate(report.document(), SCHEMA)
        return report


@pytest.fixture
def jetson(tmp_path: Path) -> FakeJetson:
    return FakeJetson(tmp_path)


def line(report: Report, ident: str) -> Any:
    (check,) = [check for check in report.checks if check.id == ident]
    return check


def test_a_ready_jetson_passes_every_check(jetson: FakeJetson) -> None:
    report = jetson.diagnose()
    assert [(c.id, c.status) for c in report.checks if c.status != "ok"] == []
    assert report.ok
    assert line(report, "platform").detail == f"{ORIN}, L4T R36.4.0 (JetPack 6)"
    assert "/usr/local/cuda/lib64/libcudla.so.1, cuDLA 1.7.0" in line(report, "cudla").detail
    assert line(report, "dla_cores").detail == "cuDLA reports 2 DLA cores"
    assert line(report, "cuda").detail == "driver 12.6, runtime 12.6, 1 device(s)"
    assert "ERROR_INVALID_PARAM" in line(report, "cuda_bindings").detail
    assert line(report, "power_mode").detail == "MAXN (mode 0)"
    assert line(report, "clocks").detail.startswith("pinned")
    assert all(check.fix is None for check in report.checks)
    document = report.document()
    assert document["platform"] == {
        "jetson": True,
        "module": ORIN,
        "l4t": "R36.4.0",
        "jetpack": "6",
    }
    assert document["versions"]["cudla"] == "1.7.0"
    assert document["versions"]["cuda_driver"] == "12.6"


# (what to change, check id, status, words in the detail, words in the fix)
Change = Callable[[FakeJetson], None]


def no_device_tree(j: FakeJetson) -> None:
    (j.root / "proc/device-tree/model").unlink()
    (j.root / "etc/nv_tegra_release").unlink()


CASES: list[tuple[str, Change, str, str, str, str]] = [
    ("not a Jetson", no_device_tree, "platform", "warn", "not a Jetson: the emulated runtime", "emulate"),
    ("no L4T release", lambda j: (j.root / "etc/nv_tegra_release").unlink(), "platform", "warn", "no L4T release", "JetPack"),
    ("no DLA on the module", lambda j: j.model("NVIDIA Jetson Orin Nano Developer Kit"), "platform", "fail", "has no DLA", "TensorRT"),
    ("no cuDLA", lambda j: (j.facts.pop("cudla_library"), j.facts.update(cudla_library_error="DynamicLibNotFoundError: libcudla.so.1")), "cudla", "fail", "cannot be loaded: DynamicLibNotFoundError", "LD_LIBRARY_PATH"),
    ("no DLA cores", lambda j: j.facts.update(dla_cores=0), "dla_cores", "fail", "reports no DLA cores", "/dev/nvhost"),
    ("cores unreadable", lambda j: (j.facts.pop("dla_cores"), j.facts.update(dla_cores_error="CudlaError: 7")), "dla_cores", "fail", "unknown: CudlaError: 7", "device tree"),
    ("no CUDA driver", lambda j: j.facts.update(driver_version=0), "cuda", "fail", "no CUDA driver", "nvidia-l4t-cuda"),
    ("runtime newer than driver", lambda j: j.facts.update(runtime_version=13000), "cuda", "fail", "newer than the driver", "forward-compatibility"),
    ("old cuda-bindings", lambda j: j.facts.update(bindings_version="12.9.0"), "cuda_bindings", "fail", "first shipped in 13.3", ">=13.3"),
    ("no cuda-bindings", lambda j: (j.facts.pop("bindings_version"), j.facts.update(bindings_version_error="PackageNotFoundError: cuda-bindings")), "cuda_bindings", "fail", "PackageNotFoundError", "pip install"),
    ("no cudla module", lambda j: (j.facts.pop("status_spelling"), j.facts.update(status_spelling_error="ImportError: cudla")), "cuda_bindings", "fail", "cannot be imported: ImportError", "reinstall"),
    ("13.3 spelling", lambda j: j.facts.update(bindings_version="13.3.1", status_spelling="ErrorInvalidParam"), "cuda_bindings", "ok", "ErrorInvalidParam (13.3 and 13.4)", ""),
    ("no NVRTC", lambda j: (j.facts.pop("nvrtc_version"), j.facts.update(nvrtc_version_error="DynamicLibNotFoundError: nvrtc")), "nvrtc", "warn", "runs on the host", "nvidia-cuda-nvrtc"),
    ("cache not writable", lambda j: (j.cache.write_text("a file"), setattr(j, "cache", j.cache / "kernels")), "kernel_cache", "warn", "is not writable", "AIODLA_CACHE_DIR"),
    ("cache writable by others", lambda j: ((j.cache / "kernels").mkdir(parents=True), (j.cache / "kernels").chmod(0o777)), "kernel_cache", "warn", "is refused (it is writable by others (mode 0777))", "chmod 700"),
    ("no nvpmodel", lambda j: (j.bin / "nvpmodel").unlink(), "power_mode", "warn", "nvpmodel not found", "ships with L4T"),
    ("a capped power mode", lambda j: j.nvpmodel(printing("NV Power Mode: 30W\n2\n")), "power_mode", "warn", "30W (mode 2): the DLA", "nvpmodel -m 0"),
    ("nvpmodel fails", lambda j: j.nvpmodel("echo 'cannot open /etc/nvpmodel.conf' >&2; exit 3"), "power_mode", "warn", "failed (status 3): cannot open", "by hand"),
    ("nvpmodel unreadable", lambda j: j.nvpmodel("echo hello"), "power_mode", "warn", "cannot read the mode", "by hand"),
    ("no jetson_clocks", lambda j: (j.bin / "jetson_clocks").unlink(), "clocks", "warn", "jetson_clocks not found", "ships with L4T"),
    ("clocks not pinned", lambda j: j.jetson_clocks(printing(LOOSE)), "clocks", "warn", "not pinned (cpu0, cpu1, EMC", "sudo jetson_clocks"),
    ("jetson_clocks needs root", lambda j: j.jetson_clocks("echo 'Error: Run jetson_clocks as root' >&2; exit 1"), "clocks", "warn", "failed (status 1)", "sudo aiodla doctor"),
    ("clocks unreadable", lambda j: j.jetson_clocks("echo nothing"), "clocks", "warn", "cannot read the clocks", "by hand"),
    ("no memfd", lambda j: setattr(j, "memfd", _raises(OSError(38, "Function not implemented"))), "shared_memory", "warn", "memfd_create failed (OSError", "isolation='thread'"),
    ("few open files", lambda j: setattr(j, "open_files", lambda: (256, 1024)), "open_files", "warn", "soft limit 256 (hard 1024)", "ulimit -n 1024"),
    ("a check that breaks", lambda j: setattr(j, "open_files", _raises(RuntimeError("boom"))), "open_files", "fail", "the check itself failed: RuntimeError: boom", "aiodla bug"),
]  # fmt: skip


def _raises(exc: BaseException) -> Callable[[], Any]:
    def call() -> Any:
        raise exc

    return call


@pytest.mark.parametrize(
    ("change", "ident", "status", "detail", "fix"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_each_missing_piece_is_one_clear_line(
    jetson: FakeJetson, change: Change, ident: str, status: str, detail: str, fix: str
) -> None:
    change(jetson)
    report = jetson.diagnose()
    check = line(report, ident)
    assert (check.status, detail in check.detail) == (status, True), check
    if status == "ok":
        assert check.fix is None
    else:
        assert check.fix is not None and fix in check.fix, check
    assert report.ok == (status != "fail")
    # The other lines are not disturbed by this one piece (the platform changes the
    # Jetson-only verdicts, the probe's facts only theirs).
    others = [c for c in report.checks if c.id != ident and c.status != "ok"]
    if change is not no_device_tree and ident != "dla_cores" and ident != "cudla":
        assert others == [], others


def test_off_a_jetson_one_line_says_so_and_the_jetson_pieces_are_ok(
    jetson: FakeJetson,
) -> None:
    no_device_tree(jetson)
    jetson.facts = {"bindings_version": "13.5.0", "status_spelling": "ERROR_INVALID_PARAM"}
    jetson.facts.update(cudla_library_error="not found", driver_version=0, runtime_version=13050)
    jetson.facts.update(nvrtc_version_error="not found")
    (jetson.bin / "nvpmodel").unlink()
    report = jetson.diagnose()
    assert report.ok
    # Nothing is to be done off a Jetson: one warning says where we are, once.
    warned = [c for c in report.checks if c.status != "ok"]
    assert [c.id for c in warned] == ["platform"], warned
    assert warned[0].detail.startswith("not a Jetson")
    assert report.lines()[-1] == "0 failed, 1 warning(s): ready"
    for ident in ("cudla", "dla_cores", "cuda"):
        assert line(report, ident).detail.startswith("not a Jetson"), line(report, ident)
    assert "none needed without a GPU" in line(report, "nvrtc").detail
    assert line(report, "power_mode").detail == "not a Jetson: no power modes"
    assert line(report, "clocks").detail == "not a Jetson: no clocks to pin"


def test_off_a_jetson_a_cuda_runtime_newer_than_its_driver_still_warns(
    jetson: FakeJetson,
) -> None:
    no_device_tree(jetson)
    jetson.facts = {"bindings_version": "13.5.0", "status_spelling": "ERROR_INVALID_PARAM"}
    jetson.facts.update(cudla_library_error="not found", driver_version=12060)
    jetson.facts.update(runtime_version=13050)
    assert line(jetson.diagnose(), "cuda").status == "warn"


class TestRootFiles:
    """--root names a tree the doctor reads; what is there is not trusted: a FIFO, a
    device or a huge file is named on the platform line, never read (nor waited on)."""

    @pytest.mark.timeout(20)
    def test_a_fifo_is_named_not_waited_on(self, jetson: FakeJetson) -> None:
        model = jetson.root / "proc/device-tree/model"
        model.unlink()
        os.mkfifo(model)
        report = jetson.diagnose()
        check = line(report, "platform")
        assert check.status == "warn"
        assert f"not read: {model} (a FIFO (named pipe), not a regular file" in check.detail
        # The release file still says it is a Jetson.
        assert report.platform.jetson and report.platform.l4t == "R36.4.0"

    def test_a_link_to_dev_zero_is_not_read(self, jetson: FakeJetson) -> None:
        release = jetson.root / "etc/nv_tegra_release"
        release.unlink()
        release.symlink_to("/dev/zero")
        check = line(jetson.diagnose(), "platform")
        assert check.status == "warn"
        assert f"{release} (a character device, not a regular file" in check.detail

    def test_a_huge_file_is_not_read(self, jetson: FakeJetson) -> None:
        release = jetson.root / "etc/nv_tegra_release"
        with release.open("wb") as file:
            file.truncate(256 << 20)  # sparse: no disk, but 256 MiB to read
        check = line(jetson.diagnose(), "platform")
        assert check.status == "warn"
        assert f"{release} (larger than 64 KiB: not read)" in check.detail
        assert check.fix is not None and "regular files" in check.fix

    @pytest.mark.timeout(30)
    def test_the_command_answers_on_a_fifo_root(self, tmp_path: Path) -> None:
        (tmp_path / "proc/device-tree").mkdir(parents=True)
        os.mkfifo(tmp_path / "proc/device-tree/model")
        result = CliRunner().invoke(_cli.cli, ["doctor", "--root", str(tmp_path)])
        assert result.exit_code == 0, result.output
        assert "a FIFO (named pipe), not a regular file" in result.output


class TestProbes:
    def test_a_probe_that_hangs_is_a_line_after_the_timeout(self, jetson: FakeJetson) -> None:
        jetson.probe = [sys.executable, "-c", "import time; time.sleep(60)"]
        jetson.nvpmodel("sleep 60")
        jetson.timeout = 1.0
        started = time.monotonic()
        report = jetson.diagnose()
        assert time.monotonic() - started < 30
        assert "did not answer within 1 s (a hung driver?)" in line(report, "cudla").detail
        assert line(report, "cudla").status == "fail"
        assert "'nvpmodel -q' did not answer within 1 s" in line(report, "power_mode").detail
        assert not report.ok

    def test_a_probe_that_crashes_is_a_line(self, jetson: FakeJetson) -> None:
        jetson.probe = [sys.executable, "-c", "import os; os.abort()"]
        report = jetson.diagnose()
        assert "died of SIGABRT" in line(report, "cudla").detail
        assert "died of SIGABRT" in line(report, "cuda_bindings").detail
        assert report.document()["versions"]["cuda_bindings"] is None

    def test_a_probe_that_prints_no_json_is_a_line(self, jetson: FakeJetson) -> None:
        jetson.probe = [sys.executable, "-c", "print('hello')"]
        assert "printed no JSON" in line(jetson.diagnose(), "dla_cores").detail

    def test_a_probe_that_cannot_start_is_a_line(self, jetson: FakeJetson) -> None:
        jetson.probe = [str(jetson.bin / "no-such-python")]
        assert "could not start" in line(jetson.diagnose(), "cuda").detail

    def test_the_real_probe_answers_here(self) -> None:
        from aiodla._doctor_probe import gather

        facts = gather()
        assert facts["bindings_version"]  # a dependency: always there
        assert facts["status_spelling"] in ("ERROR_INVALID_PARAM", "ErrorInvalidParam")
        assert ("cudla_library" in facts) != ("cudla_library_error" in facts)


class TestCommand:
    def test_here_it_passes_with_warnings_and_valid_json(self) -> None:
        result = CliRunner().invoke(_cli.cli, ["doctor", "--json", "--root", "/nonexistent"])
        assert result.exit_code == 0, result.output
        document = json.loads(result.output)
        jsonschema.validate(document, SCHEMA)
        assert document["ok"] is True
        assert document["platform"]["jetson"] is False

    def test_a_fake_jetson_without_cudla_fails_with_exit_status_1(
        self, jetson: FakeJetson, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The real probe: this machine has no libcudla.so.1, which a Jetson must have.
        monkeypatch.setenv("PATH", f"{jetson.bin}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("AIODLA_DOCTOR_ROOT", str(jetson.root))
        result = CliRunner().invoke(_cli.cli, ["doctor"])
        assert result.exit_code == 1, result.output
        lines = result.output.splitlines()
        assert lines[0].startswith(f"ok    platform       {ORIN}, L4T R36.4.0 (JetPack 6)")
        assert any(text.startswith("fail  cuDLA") for text in lines)
        assert any(text.strip().startswith("fix: install JetPack's CUDA") for text in lines)
        assert any(text.startswith("ok    power mode     MAXN (mode 0)") for text in lines)
        assert lines[-1].endswith("not ready")

    def test_the_schema_rejects_a_report_out_of_shape(self, jetson: FakeJetson) -> None:
        document = jetson.diagnose().document()
        document["checks"][0]["status"] = "maybe"
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(document, SCHEMA)
