"""README.md is the front door: short, holding the commands CI runs, its runnable code
blocks running as written, its performance figures those of the generated page."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Put on the line before a code fence, this marks the block as one a reader can paste.
RUNNABLE = "<!-- runnable -->"
# The same, for a block that needs the shell command the text before it says to run
# (``<!-- runnable after: aiodla emulate ... -->``): the test runs that command first.
RUNNABLE_AFTER = re.compile(r"<!-- runnable after: (.+) -->")
DOCS = ROOT / "docs"
MAX_LINES = 260


def readme() -> str:
    return README.read_text(encoding="utf-8")


def runnable_blocks(text: str) -> list[str]:
    """The code of every fenced block whose fence follows a RUNNABLE line."""
    return [code for _, code in runnable_blocks_after(text)]


def runnable_blocks_after(text: str) -> list[tuple[str | None, str]]:
    """(the shell command to run first, or None; the code) of every runnable block."""
    blocks = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        after = RUNNABLE_AFTER.fullmatch(line.strip())
        if line.strip() != RUNNABLE and after is None:
            continue
        fence = lines[i + 1]
        assert fence.startswith("```python"), (
            f"line {i + 2}: {line.strip()} must precede a python fence"
        )
        end = lines.index("```", i + 2)
        blocks.append((after and after[1], "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


def ci_commands() -> list[str]:
    """The README commands .ci/run runs in each fresh environment."""
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    body = script.split('source "$work/venv-$version/bin/activate"', 1)[1].split("\n    )", 1)[0]
    body = body.replace("\\\n", " ")  # continued lines as one
    commands = [line.strip() for line in body.splitlines() if line.strip().startswith("python")]
    # pip's own upgrade, and optional steps (`... || echo ...`: CI goes on without them),
    # are not the README's.
    return [c for c in commands if "--upgrade pip" not in c and "||" not in c]


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
    before, code = runnable_blocks_after(readme())[index]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if before is not None:
        # The command as the reader types it; `aiodla` is this interpreter's.
        words = shlex.split(before)
        assert words[0] == "aiodla", before
        subprocess.run(
            [sys.executable, "-m", "aiodla", *words[1:]],
            cwd=tmp_path,
            check=True,
            timeout=120,
            env=env,
            capture_output=True,
        )
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


def test_a_marker_after_a_command_finds_its_block_and_command() -> None:
    text = "<!-- runnable after: aiodla emulate -o m.bin -->\n```python\nprint(1)\n```\n"
    assert runnable_blocks_after(text) == [("aiodla emulate -o m.bin", "print(1)\n")]


def test_the_camera_block_is_runnable() -> None:
    # The README's detector example ran with no imports; now every python block under
    # "Camera to boxes" is marked and run.
    section = readme().split("## Camera to boxes", 1)[1].split("\n## ", 1)[0]
    blocks = runnable_blocks_after(section)
    assert len(blocks) == section.count("```python") == 1
    assert "from aiodla import" in blocks[0][1]


def repository() -> str:
    """The project's repository, as pyproject.toml and mkdocs.yml name it."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    changelog = pyproject["project"]["urls"]["Changelog"]
    url = changelog.split("/blob/", 1)[0]
    assert f"repo_url: {url}\n" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    return url


@pytest.mark.parametrize("page", [README, DOCS / "getting-started.md"], ids=lambda p: p.name)
def test_install_says_how_until_a_release_exists(page: Path) -> None:
    """`pip install aiodla` found nothing: until a release, the install section gives
    a clone (pip install .) and a git URL of the project's own repository."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    # Once a release is on PyPI, this test and the install sections change together.
    assert ".dev" in pyproject["project"]["version"], "released: say `pip install aiodla`"
    text = page.read_text(encoding="utf-8")
    install = text.split("## Install\n", 1)[1].split("\n## ", 1)[0]
    url = repository()
    console = re.findall(r"```console\n(.*?)```", install, re.S)
    assert console[0].splitlines() == [
        f"git clone {url} && cd {url.rsplit('/', 1)[1]}",
        "python -m pip install .",
    ]
    assert f'python -m pip install "aiodla[serve] @ git+{url}"' in install
    assert "no release on PyPI yet" in install
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        for command in block.splitlines():
            assert not re.search(r"pip install (-U )?['\"]?aiodla\b(?! @)", command), command


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


def test_each_performance_row_names_its_command() -> None:
    """A figure a reader cannot reproduce is a claim: each row names the benchmark
    that measured it, and that benchmark is in the repository."""
    section = readme().split("## Performance", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][2:]
    assert rows
    for row in rows:
        scripts = re.findall(r"`(?:python )?(benchmarks/\w+\.py)[^`]*`", row)
        assert scripts, f"no command in the row {row!r}"
        assert all((ROOT / script).is_file() for script in scripts), row


def test_links_into_the_docs_exist() -> None:
    for target in re.findall(r"\]\((docs/[^)#]+)", readme()):
        assert (ROOT / target).exists(), target
