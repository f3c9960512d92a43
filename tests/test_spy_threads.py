"""tools/spy_threads.py: py-spy's raw stacks summed per thread, filtered as asked."""

from __future__ import annotations

import runpy
import types
from pathlib import Path
from typing import Any

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "spy_threads.py"

RAW = """\
thread (0x1): MainThread;run (asyncio/runners.py:118);BaseEventLoop._run_once (asyncio/base_events.py:1910);Flow.start (aiodla/_flow.py:188);cuGraphLaunch (libcuda.so) 6
thread (0x1): MainThread;run (asyncio/runners.py:118);BaseEventLoop._run_once (asyncio/base_events.py:1910);epoll_wait (libc.so.6) 50
thread (0x1): MainThread;<module> (bench.py:3);_find_and_load (<frozen importlib._bootstrap>:1) 30
thread (0x2): aiodla-poller;Poller._sweep (aiodla/_poller.py:300);query_event (aiodla/runtime/_cuda.py:373) 4
not a stack line
"""


@pytest.fixture(scope="module")
def spy() -> Any:
    return types.SimpleNamespace(**runpy.run_path(str(TOOL)))


@pytest.fixture
def raw(tmp_path: Path) -> str:
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    return str(path)


def test_the_loop_alone_without_its_waits(spy: Any, raw: str, capsys: Any) -> None:
    spy.main([raw, "--under", "_run_once", "--idle", "epoll_wait", "--requests", "3"])
    out = capsys.readouterr().out
    assert "== event loop thread (0x1): MainThread: 6 samples (100.0 %)" in out
    assert "      6 100.0 %    2.000/req  cuGraphLaunch (libcuda.so)" in out
    assert "epoll_wait" not in out and "_find_and_load" not in out  # filtered out
    assert "poller" not in out  # no stack of it runs under the loop


def test_every_thread_named_by_its_marker(spy: Any, raw: str, capsys: Any) -> None:
    spy.main([raw, "--top", "3"])
    out = capsys.readouterr().out
    assert "== event loop thread (0x1): MainThread: 86 samples (95.6 %)" in out
    assert "== poller thread (0x2): aiodla-poller: 4 samples (4.4 %)" in out
    # one line a function, its line numbers dropped
    assert "     50  58.1 %  epoll_wait (libc.so.6)" in out
    assert "     56  65.1 %  BaseEventLoop._run_once (asyncio/base_events.py)" in out


def test_one_thread_by_its_name(spy: Any, raw: str, capsys: Any) -> None:
    spy.main([raw, "--thread", "aiodla-poller"])
    out = capsys.readouterr().out
    assert "== poller thread (0x2): aiodla-poller: 4 samples (100.0 %)" in out
    assert "MainThread" not in out
