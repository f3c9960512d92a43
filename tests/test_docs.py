"""The documentation site builds with ``mkdocs build --strict`` and holds what it must:
every public name in the API reference, the performance page's figures as viewable
PNGs with the numbers of the JSON results, internal links that the build checks.

The site is built once, into a temporary folder, with the ``docs`` extra that the
``test`` extra pulls in (CI installs it); where MkDocs is missing the build is skipped,
saying so.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.timeout(300)  # one full build: about 10-50 s, by the machine


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_{name}", ROOT / "docs" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses look their module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def mkdocs_missing() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python", "matplotlib"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return f"{module} is not installed (pip install -e '.[docs]'; the test extra has it)"
    return None


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    # Material's banner about its end of life would otherwise fill the output.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        cwd=config.parent,
        env=env,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = mkdocs_missing()
    if reason is not None:
        pytest.skip(f"cannot build the docs: {reason}")
    out = tmp_path_factory.mktemp("site")
    built = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    return out


def exported(module: str) -> list[str]:
    """The module's ``__all__`` read from its source: importing aiodla.ray would import
    Ray (and its warnings) only to read a list of names."""
    spec = importlib.util.find_spec(module)
    assert spec is not None
    assert spec.origin is not None
    for node in ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        targets = node.targets if isinstance(node, ast.Assign) else [target]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert node.value is not None  # type: ignore[attr-defined]
            return list(ast.literal_eval(node.value))  # type: ignore[attr-defined]
    raise AssertionError(f"{module} has no __all__")


def anchors(page: Path) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', page.read_text(encoding="utf-8")))


class TestSite:
    @pytest.mark.parametrize(
        ("module", "page"),
        [
            ("aiodla", "aiodla"),
            ("aiodla.testing", "testing"),
            ("aiodla.emulator", "emulator"),
            ("aiodla.compile", "compile"),
            ("aiodla.runtime", "runtime"),
            ("aiodla.metrics", "metrics"),
            ("aiodla.serve", "serve"),
            ("aiodla.ray", "ray"),
        ],
    )
    def test_every_public_name_is_in_the_api_reference(
        self, site: Path, module: str, page: str
    ) -> None:
        names = exported(module)
        if module == "aiodla":
            import aiodla

            assert names == list(aiodla.__all__)
        assert names
        found = anchors(site / "reference" / page / "index.html")
        assert {f"{module}.{name}" for name in names} - found == set()

    def test_the_engine_is_documented_from_its_docstrings(self, site: Path) -> None:
        import aiodla

        html = (site / "reference" / "aiodla" / "index.html").read_text(encoding="utf-8")
        first_line = aiodla.Engine.__doc__.strip().splitlines()[0]  # type: ignore[union-attr]
        words = re.sub(r"`+", "", first_line).split()[:4]
        assert " ".join(words) in re.sub(r"<[^>]+>", "", html).replace("\n", " ")
        assert "aiodla.Engine.infer" in anchors(site / "reference" / "aiodla" / "index.html")

    def test_performance_figures_are_pngs_the_page_shows(self, site: Path) -> None:
        page = site / "performance" / "index.html"
        html = page.read_text(encoding="utf-8")
        shown = re.findall(r'<img[^>]+src="([^"]+\.png)"', html)
        assert len(shown) >= 3
        for src in shown:
            data = (page.parent / src).read_bytes()
            assert data.startswith(PNG_MAGIC), src
            assert len(data) > 5000, src  # a drawn plot, not an empty canvas

    def test_every_guide_is_built(self, site: Path) -> None:
        for guide in ("camera", "testing", "serving", "faults", "runtimes", "cli"):
            assert (site / "guides" / guide / "index.html").is_file()

    def test_the_cores_reference_shows_its_public_api_only(self, site: Path) -> None:
        found = anchors(site / "reference" / "aiodla" / "index.html")
        for member in ("subset", "trace", "aclose", "engines", "shares"):
            assert f"aiodla.Cores.{member}" in found, member
        # What engines call on their cores is Python-public, not the application's.
        inner = {"attach", "detach", "context_lost", "runtime_for", "check_open", "poller_share"}
        assert {a for a in found if a.startswith("aiodla.Cores.")} & {
            f"aiodla.Cores.{m}" for m in inner
        } == set()


class TestStrictBuild:
    def test_a_broken_internal_link_fails_the_build(self, tmp_path: Path) -> None:
        """The site's own validation settings turn a dead link into a failed build."""
        reason = mkdocs_missing()
        if reason is not None:
            pytest.skip(f"cannot build the docs: {reason}")
        config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
        validation = config[config.index("validation:") : config.index("\nnav:")]
        (tmp_path / "docs").mkdir()
        (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the guide](guide.md).\n")
        (tmp_path / "mkdocs.yml").write_text(f"site_name: t\n{validation}\n")
        broken = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
        assert broken.returncode != 0
        assert "guide.md" in broken.stdout + broken.stderr
        (tmp_path / "docs" / "guide.md").write_text("# Guide\n")
        assert mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site").returncode == 0


class TestPerformancePage:
    def test_numbers_come_from_the_json_results(self) -> None:
        gen = load("gen_performance")
        page = gen.build(gen.RESULTS)  # drawn once here; the other tests skip the figures
        serve = json.loads((gen.RESULTS / "serve-emulated.json").read_text())["results"]
        assert f"| HTTP | {serve['http']['rps']['median']:.0f} |" in page.markdown
        ceiling = json.loads((gen.RESULTS / "standin-ceiling-h200.json").read_text())
        assert f"{ceiling['results']['100 us']['x_ideal']['median']:.3f}" in page.markdown
        assert "No Jetson was measured" in page.markdown
        assert set(page.figures) == {"throughput.png", "threads.png", "data_path.png"}

    def test_a_changed_result_changes_the_page(self, tmp_path: Path) -> None:
        gen = load("gen_performance")
        results = tmp_path / "results"
        shutil.copytree(gen.RESULTS, results)
        path = results / "serve-emulated.json"
        data = json.loads(path.read_text())
        data["results"]["http"]["rps"]["median"] = 4321.0
        path.write_text(json.dumps(data))
        assert "| HTTP | 4321 |" in gen.build(results, draw=False).markdown

    def test_tracing_cost_is_held_to_its_bounds(self, tmp_path: Path) -> None:
        gen = load("gen_performance")
        results = tmp_path / "results"
        shutil.copytree(gen.RESULTS, results)
        path = results / "trace-instructions.json"
        data = json.loads(path.read_text())
        ratios = data["ratios"]
        markdown = gen.build(results, draw=False).markdown
        for name in ("off / bare", "on / bare"):
            assert f"| {name} | {ratios[name]['median']:.4f} [" in markdown
        ratios["off / bare"] = {"median": 1.019, "min": 1.0, "max": 1.03}
        ratios["on / bare"] = {"median": 1.2, "min": 1.1, "max": 1.3}
        path.write_text(json.dumps(data))
        markdown = gen.build(results, draw=False).markdown
        assert "| off / bare | 1.0190 [1.0000..1.0300] | <= 1.02 | met by the median" in markdown
        assert "| on / bare | 1.2000 [1.1000..1.3000] | <= 1.15 | NOT met |" in markdown

    def test_a_missing_result_names_the_file(self, tmp_path: Path) -> None:
        gen = load("gen_performance")
        results = tmp_path / "results"
        shutil.copytree(gen.RESULTS, results)
        (results / "soak.json").unlink()
        with pytest.raises(SystemExit, match=r"soak\.json is missing"):
            gen.build(results, draw=False)

    def test_every_comparison_in_the_results_is_in_the_history(self) -> None:
        gen = load("gen_performance")
        markdown = gen.build(gen.RESULTS, draw=False).markdown
        for path in gen.RESULTS.glob("threads-compare-*.json"):
            assert f"`{path.name}`" in markdown

    def test_the_script_writes_the_page_and_figures(self, tmp_path: Path) -> None:
        completed = subprocess.run(
            [sys.executable, str(ROOT / "docs" / "gen_performance.py"), "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert completed.returncode == 0, completed.stderr
        assert (tmp_path / "performance.md").read_text().startswith("# Performance")
        assert (tmp_path / "performance" / "threads.png").read_bytes().startswith(PNG_MAGIC)


class TestReferencePages:
    def test_a_name_no_group_mentions_still_gets_a_block(self) -> None:
        gen = load("gen_reference")
        text = gen.page("aiodla", "aiodla", "intro", ["Engine", "SomethingNew"])
        assert "::: aiodla.Engine" in text
        assert "## Other" in text
        assert "::: aiodla.SomethingNew" in text

    def test_pages_follow_each_module_all(self) -> None:
        gen = load("gen_reference")
        pages = gen.reference_pages()
        import aiodla

        for name in aiodla.__all__:
            assert f"::: aiodla.{name}\n" in pages["reference/aiodla.md"]


class TestNavigation:
    def test_each_page_is_in_the_nav_once(self) -> None:
        config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
        nav = config.split("\nnav:\n", 1)[1]
        pages = re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.M)
        assert len(pages) == len(set(pages)), sorted(p for p in pages if pages.count(p) > 1)
        for guide in (ROOT / "docs" / "guides").glob("*.md"):
            assert f"guides/{guide.name}" in pages, guide.name

    def test_the_home_page_links_every_guide(self) -> None:
        index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
        for guide in sorted((ROOT / "docs" / "guides").glob("*.md")):
            assert f"](guides/{guide.name})" in index, guide.name
        assert "](first-hour.md)" in index

    def test_private_modules_are_pointed_to_in_the_repository(self) -> None:
        """The site renders the public modules only: a private module a page names is a
        link to its source, which a reader can open (design.md, the map of the
        modules for contributors, names them as the tree does)."""
        private = re.compile(
            r"`(aiodla(?:/[a-z_]+)*/_[a-z_]+\.py|aiodla(?:\.[a-z_]+)*\._[a-z_]+[\w.]*)`"
        )
        repository = "https://github.com/aiodla/aiodla/blob/main/"
        pages = [*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "guides").glob("*.md")]
        for page in pages:
            if page.name == "design.md":
                continue
            text = page.read_text(encoding="utf-8")
            for found in private.finditer(text):
                link = f"[{found[0]}]({repository}{found[1]})"
                assert text[found.start() - 1 : found.start() - 1 + len(link)] == link, (
                    f"{page.name}: {found[0]} is not a link to its source"
                )

    def test_members_shown_for_a_class_exist(self) -> None:
        import aiodla

        gen = load("gen_reference")
        for qualified, members in gen.MEMBERS.items():
            cls = getattr(aiodla, qualified.split(".", 1)[1])
            for member in members:
                assert hasattr(cls, member), f"{qualified}.{member}"


def test_the_docs_extra_is_in_the_test_extra() -> None:
    """CI installs the test extra only; the docs build must come with it."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    test_extra = pyproject[
        pyproject.index("\ntest = [") : pyproject.index("\n]\n", pyproject.index("\ntest = ["))
    ]
    assert '"aiodla[docs]"' in test_extra
    assert re.search(r'^docs = \[\n(    ".*",\n)*]', pyproject, re.M)
