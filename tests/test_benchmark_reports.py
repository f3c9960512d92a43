"""Benchmarks write their JSON reports where they are told, else to a temporary file:
never over the reports the repository records in ``benchmarks/results/``."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def run_layouts(cwd: Path, *args: str) -> str:
    """bench_layouts.py (the quickest benchmark), run from ``cwd``; its output."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_layouts.py", "--rounds", "2", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the benchmarks, with a recorded report in its results folder."""
    shutil.copytree(BENCHMARKS, tmp_path / "benchmarks", ignore=shutil.ignore_patterns("results"))
    (tmp_path / "benchmarks" / "results").mkdir()
    (tmp_path / "benchmarks" / "results" / "layouts.json").write_text('{"recorded": true}\n')
    return tmp_path


def recorded(checkout: Path) -> dict[str, str]:
    results = checkout / "benchmarks" / "results"
    return {path.name: path.read_text() for path in results.iterdir()}


@pytest.mark.timeout(300)
def test_a_run_writes_a_temporary_report_and_says_where(checkout: Path) -> None:
    before = recorded(checkout)
    output = run_layouts(checkout)
    assert recorded(checkout) == before, "the recorded report was overwritten"
    written = re.findall(r"^wrote (.+)$", output, re.MULTILINE)
    assert written, output
    path = Path(written[-1])
    assert path.is_file()
    assert not path.resolve().is_relative_to(checkout.resolve())
    assert "cases" in json.loads(path.read_text())
    shutil.rmtree(path.parent)


@pytest.mark.timeout(300)
def test_json_names_the_report(checkout: Path) -> None:
    target = checkout / "benchmarks" / "results" / "layouts.json"  # asked for: written
    output = run_layouts(checkout, "--json", str(target))
    assert f"wrote {target}" in output
    assert "cases" in json.loads(target.read_text())


def _defaults_into_results(path: Path) -> list[str]:
    """Code in a benchmark (not its docstrings) that names benchmarks/results."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        text = node.value if isinstance(node, ast.Constant) else None
        if isinstance(text, str) and id(node) not in docstrings and "benchmarks/results" in text:
            found.append(f"{path.name}:{node.lineno}: {text!r}")
        # ... / "results": a path built from parts
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant)
            and node.right.value == "results"
        ):
            found.append(f"{path.name}:{node.lineno}: a path into results")
    return found


def test_no_benchmark_writes_into_results_by_default() -> None:
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert len(scripts) > 10
    found = [line for script in scripts for line in _defaults_into_results(script)]
    assert found == []


def test_the_readmes_instruction_counts_are_the_recorded_ones() -> None:
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    found = re.search(
        r"the event loop ran ([\d,]+) instructions per request at (\w+) against ([\d,]+) at (\w+)",
        readme,
    )
    assert found, "README states the host cost in instructions, with the commits measured"
    for count, commit in ((found[1], found[2]), (found[3], found[4])):
        assert int(count.replace(",", "")) in _recorded_loop_counts(commit), (count, commit)


def _recorded_loop_counts(commit: str) -> set[int]:
    """The event loop's instructions per request recorded for ``commit``: a report of
    one tree named after it, or a tree of a comparison (its median) whose revision
    names it."""
    counts = set()
    for path in (BENCHMARKS / "results").glob("instructions-*.json"):
        report = json.loads(path.read_text())
        if path.name == f"instructions-{commit}.json" and "trees" not in report:
            counts.add(round(report["loop_instructions_per_request"]))
        for tree in report.get("trees", []):
            if re.search(rf"\b{commit}\b", tree["revision"]):
                counts.add(round(tree["loop_instructions_per_request"]["median"]))
    return counts
