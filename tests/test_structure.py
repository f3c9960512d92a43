"""The package's structure: which module may import and call what, and module sizes.

A request reads engine -> flow -> scheduler -> cores -> runtime -> poller; these rules
keep it so. They read the source with ``ast``, so they hold for every code path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aiodla"
MODULES = sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse(name: str) -> ast.Module:
    path = next(p for p in MODULES if module_name(p) == name)
    return ast.parse(path.read_text(), str(path))


def imported(name: str) -> set[str]:
    """Every module ``name`` imports, as absolute names (``from . import x`` included)."""
    tree = parse(name)
    is_package = next(p for p in MODULES if module_name(p) == name).name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                prefix = ".".join(anchor + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


def runtime_methods() -> set[str]:
    """The methods of the Runtime protocol."""
    tree = parse("aiodla.runtime._protocol")
    protocol = next(
        node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "Runtime"
    )
    return {node.name for node in protocol.body if isinstance(node, ast.FunctionDef)}


# Protocol methods whose names are common elsewhere (file.close(), ...): a call of one of
# them counts only when its receiver is spelled as a runtime.
GENERIC = {"close", "free", "version", "make_current", "pack", "unpack", "device"}


def runtime_calls(name: str) -> list[str]:
    methods = runtime_methods()
    calls = []
    for node in ast.walk(parse(name)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = ast.unparse(node.func.value)
        method = node.func.attr
        if method in methods and ("runtime" in receiver.lower() or method not in GENERIC):
            calls.append(f"{name}:{node.lineno}: {receiver}.{method}()")
    return calls


def test_the_scheduler_knows_no_runtime_and_no_tensors() -> None:
    bad = {
        module
        for module in imported("aiodla._scheduler")
        if module.startswith(("aiodla.runtime", "aiodla._tensors", "aiodla._layout"))
    }
    assert not bad


def test_the_engine_imports_nothing_from_the_emulator() -> None:
    assert not {m for m in imported("aiodla._engine") if m.startswith("aiodla.emulator")}


def test_testing_imports_nothing_from_the_cli() -> None:
    for name in (module_name(p) for p in MODULES):
        if name.startswith("aiodla.testing"):
            assert not {m for m in imported(name) if m.startswith("aiodla._cli")}, name


def test_only_the_device_layer_and_the_runtimes_call_the_runtime() -> None:
    # aiodla.testing's controls are a runtime layer of their own (over the emulated
    # runtime, which they extend and own), so they may drive it. With
    # isolation="process" the worker process hosts the device layer: its main module
    # and its shared staging own the runtime there.
    allowed = (  # the device layer: _core_setup opens it, _cores drives it
        "aiodla._core_setup",
        "aiodla._cores",
        "aiodla._data_path",
        "aiodla._frame_buffers",  # the device layer's pinned memory, lent to the caller
        "aiodla._graphs",
        "aiodla._inspection",
        "aiodla._isolation._staging",
        "aiodla._isolation._worker",
        "aiodla.runtime",
        "aiodla.testing._controls",
    )
    calls = [
        call
        for path in MODULES
        if not module_name(path).startswith(allowed)
        for call in runtime_calls(module_name(path))
    ]
    assert calls == []


def test_the_rule_sees_a_runtime_call() -> None:
    # The check above must be able to fail: the device layer does call the runtime.
    assert any("submit_task" in call for call in runtime_calls("aiodla._cores"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_classes_stay_small(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= 600, "a module past 600 lines holds more than one concept"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= 400, f"class {node.name} is {length} lines"
