"""The cache directory: created private, and a folder or entry that another user could
have written (a symbolic link, another owner, writable by the group or the world) is
refused with a warning naming it; the program is then compiled and kept in memory.

Driven through the conversion kernels' build with a fake compiler (the compiled code is
what a cache entry holds, and what the process would load)."""

from __future__ import annotations

import os
import re
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodla._tensors import TensorSpec
from aiodla.runtime import _conversion_kernels as ck

from support import FakeToolchain

SPEC = TensorSpec("img", (1, 3, 8, 8), "float16", "chw16")


@pytest.fixture(autouse=True)
def _umask() -> Iterator[None]:
    """The usual umask: what is created 0700 is so by intent, not by the umask."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def compile_in(folder: Path | None) -> ck.ConversionKernels:
    return ck.ConversionKernels.compile(
        [(SPEC, np.dtype(np.float32))], [(SPEC, np.dtype(np.float16))], cache_dir=folder
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def refused(path: Path, reason: str) -> Any:
    """Expect the one warning that names ``path`` and says why."""
    return pytest.warns(UserWarning, match=re.escape(str(path)) + r".*" + re.escape(reason))


class TestCreated:
    def test_the_directories_are_0700(
        self, fake_toolchain: FakeToolchain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        root = tmp_path / "deep" / "aiodla"
        monkeypatch.setenv("AIODLA_CACHE_DIR", str(root))
        compile_in(None)
        assert [mode(p) for p in (tmp_path / "deep", root, root / "kernels")] == [0o700] * 3
        (entry,) = (root / "kernels").glob("*.cubin")
        assert mode(entry) == 0o600
        assert compile_in(None).compiled_from_cache  # and it serves

    def test_an_existing_private_folder_is_used_as_it_is(
        self, fake_toolchain: FakeToolchain, tmp_path: Path
    ) -> None:
        folder = tmp_path / "kernels"
        folder.mkdir(mode=0o755)  # not writable by others: safe, left alone
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile_in(folder)
            assert compile_in(folder).compiled_from_cache
        assert mode(folder) == 0o755


class TestFolderRefused:
    @pytest.mark.parametrize("bits", [0o777, 0o770, 0o702], ids=oct)
    def test_writable_by_others(
        self, fake_toolchain: FakeToolchain, tmp_path: Path, bits: int
    ) -> None:
        folder = tmp_path / "kernels"
        folder.mkdir()
        folder.chmod(bits)
        with refused(folder, f"writable by others (mode {bits:04o})"):
            assert not compile_in(folder).compiled_from_cache
        with refused(folder, "writable by others"):
            assert not compile_in(folder).compiled_from_cache  # in memory: built again
        assert fake_toolchain.compiled == 2
        assert list(folder.iterdir()) == []  # nothing written there

    def test_a_symbolic_link(self, fake_toolchain: FakeToolchain, tmp_path: Path) -> None:
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        folder = tmp_path / "kernels"
        folder.symlink_to(target)
        with refused(folder, "symbolic link"):
            assert not compile_in(folder).compiled_from_cache
        assert list(target.iterdir()) == []

    def test_owned_by_another_user(
        self, fake_toolchain: FakeToolchain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        folder = tmp_path / "kernels"
        folder.mkdir(mode=0o700)
        monkeypatch.setattr(os, "geteuid", lambda: os.lstat(folder).st_uid + 1)
        with refused(folder, "owned by another user"):
            assert not compile_in(folder).compiled_from_cache
        assert list(folder.iterdir()) == []


class TestEntryRefused:
    """A planted or loosened entry is never loaded, and left where it is."""

    @pytest.fixture
    def entry(self, fake_toolchain: FakeToolchain, tmp_path: Path) -> Path:
        compile_in(tmp_path)
        (entry,) = tmp_path.glob("*.cubin")
        return entry

    @pytest.mark.parametrize("bits", [0o666, 0o620], ids=oct)
    def test_writable_by_others(
        self, fake_toolchain: FakeToolchain, entry: Path, bits: int
    ) -> None:
        entry.chmod(bits)
        before = entry.read_bytes()
        with refused(entry, f"writable by others (mode {bits:04o})"):
            assert not compile_in(entry.parent).compiled_from_cache
        assert fake_toolchain.compiled == 2
        assert entry.read_bytes() == before and mode(entry) == bits

    def test_a_symbolic_link(
        self, fake_toolchain: FakeToolchain, entry: Path, tmp_path: Path
    ) -> None:
        # A link to a whole, checksummed entry elsewhere: still not followed.
        planted = tmp_path / "planted"
        planted.mkdir()
        real = planted / "code.cubin"
        entry.rename(real)
        entry.symlink_to(real)
        with refused(entry, "symbolic link"):
            assert not compile_in(entry.parent).compiled_from_cache
        assert entry.is_symlink() and fake_toolchain.compiled == 2

    def test_owned_by_another_user(
        self, fake_toolchain: FakeToolchain, entry: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        real_fstat = os.fstat

        def another_owner(descriptor: int) -> os.stat_result:
            info = real_fstat(descriptor)
            fields = list(info[:10])
            fields[4] = info.st_uid + 1  # st_uid
            return os.stat_result(fields)

        monkeypatch.setattr(os, "fstat", another_owner)
        with refused(entry, "owned by another user"):
            assert not compile_in(entry.parent).compiled_from_cache
        assert fake_toolchain.compiled == 2
