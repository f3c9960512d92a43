"""``benchmarks/bench_trace.py --without-hooks``: the ``bare`` tree it measures tracing's
cost against is this tree with every trace hook taken out and nothing else, so a hook of
another shape (which it would leave in, and count as free) stops it."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_trace", ROOT / "benchmarks" / "bench_trace.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hooks_in(tree: Path) -> int:
    """``if self.trace is not None:`` tests in the package under ``tree``."""
    count = 0
    for path in (tree / "aiodla").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "self.trace is not None":
                count += 1
    return count


def test_every_hook_and_nothing_else_is_taken_out(bench: ModuleType, tmp_path: Path) -> None:
    assert hooks_in(ROOT) >= 6  # the flow's, the scheduler's, the device layer's, the poller's
    bare = bench.without_hooks(ROOT, tmp_path)
    assert hooks_in(bare) == 0
    for path in (ROOT / "aiodla").rglob("*.py"):
        mine = path.read_text().splitlines()
        theirs = (bare / path.relative_to(ROOT)).read_text().splitlines()
        gone = [line for line in mine if line not in theirs]
        assert all("self.trace" in line for line in gone), (path, gone)
        assert len(mine) - len(theirs) == len(gone)


def test_a_hook_of_another_shape_stops_it(bench: ModuleType, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "aiodla").mkdir(parents=True)
    (tree / "aiodla" / "m.py").write_text(
        "class A:\n    def f(self):\n        if self.trace is not None:\n"
        "            x = 1\n            self.trace.step(x)\n"
    )
    with pytest.raises(SystemExit, match="a trace hook of another shape"):
        bench.without_hooks(tree, tmp_path / "bare")


def test_a_tree_without_hooks_is_refused(bench: ModuleType, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "aiodla").mkdir(parents=True)
    (tree / "aiodla" / "m.py").write_text("x = 1\n")
    with pytest.raises(SystemExit, match="no trace hooks found"):
        bench.without_hooks(tree, tmp_path / "bare")
