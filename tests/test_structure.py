"""The package's structure: which module may import and call what, and which one writes
each field of a core's and a request's records.

A request reads engine -> flow -> scheduler -> cores -> runtime -> poller; these rules
keep it so. They read the source with ``ast``, so they hold for every code path.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aiodla"
MODULES = sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def parse(name: str) -> ast.Module:
    path = next(p for p in MODULES if module_name(p) == name)
    return ast.parse(path.read_text(), str(path))


def imports(name: str) -> list[tuple[str, tuple[str, ...]]]:
    """Each import of module ``name`` as (absolute module, names taken from it): ``import
    x`` gives ``("x", ())``. Function-level imports and those under ``TYPE_CHECKING``
    are included: each is a dependency a reader follows. The one walk over imports
    that every rule below reads."""
    is_package = next(p for p in MODULES if module_name(p) == name).name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(parse(name)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                prefix = ".".join(anchor + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.append((prefix, tuple(alias.name for alias in node.names)))
    return found


def imported(name: str) -> set[str]:
    """Every module ``name`` imports, as absolute names (``from . import x`` included)."""
    found: set[str] = set()
    for module, names in imports(name):
        found.add(module)
        found.update(f"{module}.{alias}" for alias in names)
    return found


def protocol_methods(name: str) -> set[str]:
    """The methods a protocol of the runtime seam declares itself."""
    tree = parse("aiodla.runtime._protocol")
    protocol = next(
        node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == name
    )
    return {node.name for node in protocol.body if isinstance(node, ast.FunctionDef)}


def runtime_methods() -> set[str]:
    """The methods of the Runtime protocol and of each capability built on it."""
    tree = parse("aiodla.runtime._protocol")
    protocols = [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef) and "Runtime" in {*base_names(node), node.name}
    ]
    return set().union(*(protocol_methods(name) for name in protocols))


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
    allowed = (  # the device layer: _core_setup opens it, _local_device drives it
        "aiodla._core_setup",
        "aiodla._local_device",
        "aiodla._data_path",
        "aiodla._frame_buffers",  # the device layer's pinned memory, lent to the caller
        "aiodla._graphs",
        "aiodla._inspection",
        "aiodla._postprocess_stream",  # the data path's detector step
        "aiodla._isolation._shared_frames",  # the worker's side: frame buffers it page-locks
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
    assert any("submit_task" in call for call in runtime_calls("aiodla._local_device"))


# -- the runtime seam: a small core; capabilities asked with isinstance ---------------------

# What every runtime does. A call only some runtimes make is a capability of its own.
CORE_METHODS_AT_MOST = 30
CAPABILITIES = (
    "GraphCapture",
    "Kernels",
    "HostRegistration",
    "ComputeFunctions",
    "FaultControls",
    "WorkerControls",
)


def test_the_core_runtime_protocol_stays_small() -> None:
    methods = protocol_methods("Runtime")
    assert len(methods) <= CORE_METHODS_AT_MOST, sorted(methods)


def test_each_capability_is_a_runtime_checkable_protocol() -> None:
    from aiodla.runtime import _protocol

    for name in CAPABILITIES:
        isinstance(object(), getattr(_protocol, name))  # raises when not runtime_checkable


def probes(tree: ast.Module) -> list[str]:
    """``hasattr(runtime, ...)`` and ``getattr(runtime, ..., default)``: asking a runtime
    whether it has a call instead of whether it is of a capability."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        probe = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
        if probe and "runtime" in ast.unparse(node.args[0]).lower():
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_probes_a_runtime_for_a_call() -> None:
    found = [
        f"{module_name(p)}:{probe}" for p in MODULES for probe in probes(parse(module_name(p)))
    ]
    assert found == []


def test_the_probe_rule_sees_a_probe() -> None:
    source = "r = getattr(runtime, 'host_register', None)\nhasattr(self._runtime, 'hold')\n"
    assert len(probes(ast.parse(source))) == 2
    assert probes(ast.parse("isinstance(runtime, HostRegistration)\n")) == []


# -- one writing module per field -------------------------------------------------------

# The records whose every field has one writing module, by how a receiver of each is
# spelled where it is written: ``record.held``, ``slot.core.in_rotation``,
# ``request.state``. (Construction in the class's own module assigns through ``self``
# and is not a write by another owner.)
RECORDS = {
    "record": "aiodla._core_record:CoreRecord",
    "core": "aiodla._slots:CoreLane",
    "request": "aiodla._scheduler:Request",
}


def record_fields() -> dict[str, tuple[str, set[str]]]:
    """Per receiver name: the record's class and its fields."""
    import dataclasses
    import importlib

    found = {}
    for receiver, where in RECORDS.items():
        module, name = where.split(":")
        cls = getattr(importlib.import_module(module), name)
        fields = (
            {f.name for f in dataclasses.fields(cls)}
            if dataclasses.is_dataclass(cls)
            else set(cls.__slots__)
        )
        found[receiver] = (name, fields)
    return found


def field_writes(name: str, tree: ast.Module) -> dict[tuple[str, str], set[str]]:
    """Each (record, field) module ``name`` assigns (``=``, ``+=``, a tuple target)."""
    fields = record_fields()
    writes: dict[tuple[str, str], set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                if not isinstance(item, ast.Attribute):
                    continue
                receiver = item.value
                if isinstance(receiver, ast.Attribute):
                    spelled = receiver.attr
                elif isinstance(receiver, ast.Name):
                    spelled = receiver.id
                else:
                    continue
                if spelled in fields and item.attr in fields[spelled][1]:
                    writes.setdefault((fields[spelled][0], item.attr), set()).add(name)
    return writes


def writers() -> dict[tuple[str, str], set[str]]:
    """Every engine module's writes of the records' fields (the runtimes and the
    emulator have cores of their own, which these rules are not about)."""
    found: dict[tuple[str, str], set[str]] = {}
    for path in MODULES:
        name = module_name(path)
        if name.startswith(("aiodla.runtime", "aiodla.emulator")):
            continue
        for key, modules in field_writes(name, parse(name)).items():
            found.setdefault(key, set()).update(modules)
    return found


def test_each_field_of_a_core_and_a_request_has_one_writing_module() -> None:
    shared = {f"{r}.{f}": sorted(m) for (r, f), m in writers().items() if len(m) > 1}
    assert shared == {}


def test_the_core_record_is_written_by_its_own_module_alone() -> None:
    record = {m for (r, _), ms in writers().items() if r == "CoreRecord" for m in ms}
    assert record == {"aiodla._core_record"}


def test_the_single_writer_rule_sees_a_second_writer() -> None:
    # The rule must be able to fail: a module writing a field the scheduler owns.
    tree = ast.parse("request.state = 1\nslot.core.in_rotation, x = False, 2\n")
    assert field_writes("aiodla._elsewhere", tree) == {
        ("Request", "state"): {"aiodla._elsewhere"},
        ("CoreLane", "in_rotation"): {"aiodla._elsewhere"},
    }
    assert writers()[("Request", "state")] == {"aiodla._scheduler"}


def test_the_dispatcher_alone_writes_the_fault_policy_and_the_pairing() -> None:
    # Which cores are in rotation, their runs of failures, and which slot a request
    # holds are the dispatcher's decision (the flow and the scheduler only ask).
    found = writers()
    for field in ("in_rotation", "consecutive_failures"):
        assert found[("CoreLane", field)] == {"aiodla._dispatch"}, field
    assert found[("Request", "slot")] == {"aiodla._dispatch"}


# -- imports: no cycle, and each layer imports only what lies below it --------------------


def import_graph() -> dict[str, set[str]]:
    """Each aiodla module -> the aiodla modules it imports. ``from package import name``
    imports the module ``name`` where there is one, else the package."""
    paths = {module_name(path) for path in MODULES}
    graph: dict[str, set[str]] = {}
    for name in paths:
        targets: set[str] = set()
        for module, names in imports(name):
            if not names:
                targets.add(module)
            for alias in names:
                full = f"{module}.{alias}"
                targets.add(full if full in paths else module)
        graph[name] = set()
        for target in targets:
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other in a loop (Tarjan's strongly
    connected components of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


# The engine's modules: what a request passes, and what is built on it. Below them lie
# the shared definitions (errors, tensors, layouts, conversions, statistics, options,
# device arrays, the frame arithmetic) that the runtimes may use too.
ENGINE = (
    "aiodla._bench",
    "aiodla._bindings",
    "aiodla._cli",
    "aiodla._core_record",
    "aiodla._core_setup",
    "aiodla._local_device",
    "aiodla._data_path",
    "aiodla._device",
    "aiodla._engine",
    "aiodla._dispatch",
    "aiodla._flow",
    "aiodla._graphs",
    "aiodla._inspection",
    "aiodla._isolation",
    "aiodla._life",
    "aiodla._observation",
    "aiodla._offload",
    "aiodla._poller",
    "aiodla._preprocess",
    "aiodla._scheduler",
    "aiodla._session",
    "aiodla._shared_cores",
    "aiodla._slots",
    "aiodla.metrics",
    "aiodla.ray",
    "aiodla.serve",
    "aiodla.testing",
)


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def layering_violations(graph: dict[str, set[str]], rule: str) -> list[str]:
    """The imports of ``graph`` that break ``rule`` (one of :data:`LAYERS`)."""
    bad = []
    if rule == "the CUDA runtime reaches nothing of the emulator":
        # Test doubles and emulator formats do not reach the real path: nothing the
        # CUDA runtime's modules import, however indirectly, is the emulator's.
        for name in graph:
            if name.startswith("aiodla.runtime._cuda"):
                bad += [
                    f"{name} -> {m}"
                    for m in reachable(graph, name)
                    if under(m, ("aiodla.emulator",))
                ]
        return sorted(bad)
    sources, forbidden = {
        "runtime/ imports no engine module": (("aiodla.runtime",), ENGINE),
        "_isolation imports nothing of the emulator": (
            ("aiodla._isolation",),
            ("aiodla.emulator",),
        ),
        "emulator/ uses the public API and runtime/ only": (("aiodla.emulator",), ENGINE),
    }[rule]
    for name, targets in graph.items():
        if under(name, sources):
            bad += [f"{name} -> {m}" for m in targets if under(m, forbidden)]
    return sorted(bad)


LAYERS = (
    "the CUDA runtime reaches nothing of the emulator",
    "runtime/ imports no engine module",
    "_isolation imports nothing of the emulator",
    "emulator/ uses the public API and runtime/ only",
)
GRAPH = import_graph()


def test_no_module_of_aiodla_imports_itself_in_a_cycle() -> None:
    assert cycles(GRAPH) == []


def test_the_cycle_rule_sees_a_cycle() -> None:
    # The check above must be able to fail: a loop of three and a module hanging off it.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    with_a_cycle = {**GRAPH, "aiodla._errors": GRAPH["aiodla._errors"] | {"aiodla._engine"}}
    assert any("aiodla._engine" in cycle for cycle in cycles(with_a_cycle))


@pytest.mark.parametrize("rule", LAYERS)
def test_each_layer_imports_only_what_lies_below_it(rule: str) -> None:
    assert layering_violations(GRAPH, rule) == []


# One import that breaks each rule, added to the package's real graph.
UPWARD = {
    "the CUDA runtime reaches nothing of the emulator": (
        "aiodla.runtime._cuda_errors",
        "aiodla.emulator._format",
    ),
    "runtime/ imports no engine module": ("aiodla.runtime._protocol", "aiodla._preprocess"),
    "_isolation imports nothing of the emulator": (
        "aiodla._isolation._remote",
        "aiodla.emulator._standin",
    ),
    "emulator/ uses the public API and runtime/ only": (
        "aiodla.emulator._recording",
        "aiodla._engine",
    ),
}


@pytest.mark.parametrize("rule", LAYERS)
def test_each_layering_rule_sees_an_upward_import(rule: str) -> None:
    source, target = UPWARD[rule]
    assert f"{source} -> {target}" not in layering_violations(GRAPH, rule)
    graph = {**GRAPH, source: GRAPH[source] | {target}}
    assert f"{source} -> {target}" in layering_violations(graph, rule)


def base_names(node: ast.ClassDef) -> list[str]:
    return [ast.unparse(base).rpartition(".")[2] for base in node.bases]
