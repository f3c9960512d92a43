"""README.md is the front door: short, holding the commands CI runs, its runnable code
blocks running as written, its performance figures those of the generated page."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Put on the line before a code fence, this marks the block as one a reader can paste.
RUNNABLE = "<!-- runnable -->"
MAX_LINES = 260


def readme() -> str:
    return README.read_text(encoding="utf-8")


def runnable_blocks(text: str) -> list[str]:
    """The code of every fenced block whose fence follows a RUNNABLE line."""
    blocks = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != RUNNABLE:
            continue
        fence = lines[i + 1]
        assert fence.startswith("```python"), (
            f"line {i + 2}: {RUNNABLE} must precede a python fence"
        )
        end = lines.index("```", i + 2)
        blocks.append("\n".join(lines[i + 2 : end]) + "\n")
    return blocks


def ci_commands() -> list[str]:
    """The README commands .ci/run runs in each fresh environment."""
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    body = script.split('source "$work/venv-$version/bin/activate"', 1)[1].split(")", 1)[0]
    commands = [line.strip() for line in body.splitlines() if line.strip().startswith("python")]
    return [c for c in commands if "--upgrade pip" not in c]


def test_the_readme_is_short() -> None:
    assert len(readme().splitlines()) <= MAX_LINES


def test_it_holds_the_commands_ci_runs_in_order() -> None:
    commands = ci_commands()
    assert commands == [
        'python -m pip install -e ".[test]"',
        "python examples/quickstart.py",
        "python -m pytest -q",
    ]
    console = re.findall(r"```console\n(.*?)```", readme(), re.S)
    assert any(block.splitlines() == commands for block in console)


def test_a_marker_finds_its_block() -> None:
    text = f"a\n{RUNNABLE}\n```python\nprint(1)\n```\n\n```python\nprint(2)\n```\n"
    assert runnable_blocks(text) == ["print(1)\n"]


def test_there_is_something_to_run() -> None:
    assert runnable_blocks(readme())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("index", range(len(runnable_blocks(readme()))))
def test_each_runnable_block_runs(index: int, tmp_path: Path) -> None:
    code = runnable_blocks(readme())[index]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
        env=env,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]


def test_a_failing_block_fails_its_test(tmp_path: Path) -> None:
    """The runner reports a block that raises (so a broken README example cannot pass)."""
    completed = subprocess.run(
        [sys.executable, "-c", "raise SystemExit('broken example')"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode != 0


def test_the_performance_summary_is_the_generated_pages() -> None:
    section = readme().split("## Performance", 1)[1].split("\n## ", 1)[0]
    assert "No Jetson was measured" in section
    assert len(section.strip().splitlines()) <= 12  # a heading's worth over ten lines
    spec = importlib.util.spec_from_file_location(
        "readme_gen_performance", ROOT / "docs" / "gen_performance.py"
    )
    assert spec is not None
    assert spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    page = gen.build(gen.RESULTS, draw=False).markdown
    glance = page.split("## At a glance", 1)[1].split("\n## ", 1)[0]
    figures = re.findall(r"\d+\.\d+ x", section)
    assert figures
    for figure in figures:
        assert figure in glance, f"README's {figure!r} is not on the performance page"


def test_links_into_the_docs_exist() -> None:
    for target in re.findall(r"\]\((docs/[^)#]+)", readme()):
        assert (ROOT / target).exists(), target
