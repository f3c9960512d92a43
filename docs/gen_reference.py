"""The API reference pages, written from each public module's ``__all__``.

Every name a module exports gets a ``::: module.name`` block that mkdocstrings renders
from its docstring; a name the groups below do not mention still gets one, under
"Other", so a new export can never be missing from the reference. The modules are read
with ``ast``, not imported: building the docs needs no GPU libraries.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Page (under reference/) -> (module, source file, title, introduction).
MODULES = {
    "aiodla.md": ("aiodla", "aiodla/__init__.py", "aiodla", "The engine and what it returns."),
    "testing.md": (
        "aiodla.testing",
        "aiodla/testing/__init__.py",
        "aiodla.testing",
        "The pytest plugin's fixtures and the emulated DLA's controls "
        "([Testing your application](../guides/testing.md)).",
    ),
    "emulator.md": (
        "aiodla.emulator",
        "aiodla/emulator/__init__.py",
        "aiodla.emulator",
        "Emulator loadables and what the emulated DLA computes.",
    ),
    "compile.md": (
        "aiodla.compile",
        "aiodla/compile/__init__.py",
        "aiodla.compile",
        "From a detector's ONNX export to a loadable the DLA runs whole "
        "([the first hour on a Jetson](../first-hour.md"
        "#2-aiodla-compile-from-a-detectors-onnx-file-to-a-loadable-the-dla-runs-whole)).",
    ),
    "runtime.md": (
        "aiodla.runtime",
        "aiodla/runtime/__init__.py",
        "aiodla.runtime",
        "The runtime seam and its implementations "
        "([Runtimes and the GPU data path](../guides/runtimes.md)).",
    ),
    "metrics.md": (
        "aiodla.metrics",
        "aiodla/metrics.py",
        "aiodla.metrics",
        "Prometheus export ([Serving and Ray](../guides/serving.md#metrics)).",
    ),
    "serve.md": (
        "aiodla.serve",
        "aiodla/serve/__init__.py",
        "aiodla.serve",
        "The KServe v2 / Triton protocol server ([Serving and Ray](../guides/serving.md)).",
    ),
    "ray.md": (
        "aiodla.ray",
        "aiodla/ray.py",
        "aiodla.ray",
        "A Ray Serve deployment, one engine per Jetson "
        "([Serving and Ray](../guides/serving.md#a-fleet-of-jetsons-on-ray-serve)).",
    ),
}

# Classes whose every un-underscored member is not for applications: the members the
# reference shows, by name. ``Cores`` has methods that its engines call on it
# (``attach``, ``detach``, ``context_lost``, ``runtime_for``, ``poller_share``, ...),
# public in Python's sense only; tests/test_docs.py checks that each name listed here
# exists, so a rename cannot drop it from the page unnoticed.
MEMBERS = {
    "aiodla.Cores": [
        "cores",
        "runtime",
        "subset",
        "open",
        "aclose",
        "trace",
        "engines",
        "shares",
        "pollers",
    ],
    "aiodla.CoreSet": [],
}

# The top-level names in the order a reader meets them; anything else falls to "Other".
GROUPS = {
    "aiodla": [
        ("The engine", ["Engine", "BlockingEngine", "EngineOptions", "EngineState"]),
        ("Tensors and inputs", ["TensorSpec", "ImagePreprocess", "Geometry", "DeviceTensor"]),
        (
            "Camera streams",
            [
                "VideoSource",
                "VideoFrame",
                "VideoSourceStatistics",
                "VideoSourceState",
                "LatestFrameStream",
                "FrameResult",
                "StreamState",
                "StreamStatistics",
            ],
        ),
        ("The timeline", ["TraceRecorder"]),
        (
            "Statistics and health",
            [
                "EngineStatistics",
                "CoreStatistics",
                "EngineHealth",
                "LatencySummary",
                "Histogram",
                "StageTimes",
                "WorkerStatistics",
            ],
        ),
        (
            "Errors",
            [
                "AiodlaError",
                "InputError",
                "InputTypeError",
                "InputValueError",
                "QueueFullError",
                "RequestTimeoutError",
                "EngineClosedError",
                "EngineDeadError",
                "WorkerLostError",
                "TaskError",
                "DeviceError",
                "ModelError",
                "ComputeError",
                "LoadableFormatError",
                "ConfigurationError",
                "RuntimeUnavailableError",
                "StreamClosedError",
                "VideoSourceError",
            ],
        ),
        ("Runtimes", ["EmulatedRuntime"]),
    ],
}


def exported_names(source: Path) -> list[str]:
    """The module's ``__all__``, read from its source."""
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert node.value is not None
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{source} has no __all__")


def page(module: str, title: str, intro: str, names: list[str]) -> str:
    lines = [f"# {title}", "", intro, ""]
    groups = GROUPS.get(module, [])
    placed: set[str] = set()
    sections: list[tuple[str, list[str]]] = []
    for heading, members in groups:
        present = [name for name in members if name in names]
        placed.update(present)
        if present:
            sections.append((heading, present))
    rest = [name for name in names if name not in placed]
    if rest:
        sections.append(("Other" if groups else "", rest))
    for heading, members in sections:
        if heading:
            lines += [f"## {heading}", ""]
        for name in members:
            level = 3 if heading else 2
            lines += [f"::: {module}.{name}", "    options:", f"      heading_level: {level}"]
            shown = MEMBERS.get(f"{module}.{name}")
            if shown is not None:
                lines.append(
                    f"      members: [{', '.join(shown)}]" if shown else "      members: false"
                )
            lines.append("")
    return "\n".join(lines)


def reference_pages(root: Path = ROOT) -> dict[str, str]:
    """Page path (relative to docs/) -> Markdown, one page a public module."""
    pages = {}
    for name, (module, source, title, intro) in MODULES.items():
        pages[f"reference/{name}"] = page(module, title, intro, exported_names(root / source))
    return pages


if __name__ == "__main__":
    for path, text in reference_pages().items():
        print(f"--- {path}\n{text}")
