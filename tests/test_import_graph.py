# SPDX-License-Identifier: Apache-2.0
"""Imports go down the package's layers: no module imports one of a higher layer, none imports one that imports
it back (function-level imports included), and the runtime package never imports the tests' harness."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_ascend_routing"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path, modules: set[str], type_checking: bool = False) -> set[str]:
    """Package modules ``path`` imports at run time (``if TYPE_CHECKING:`` blocks, which are not run, only with
    ``type_checking``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if is_type_checking_block(node) and not type_checking:
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return (found & modules) - {name}


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports_of(path, modules, type_checking) for path in paths}


def room_of(module: str) -> str:
    """The room a module is in: its top-level module or folder of the package (``kv.follower`` is in ``kv``; the
    package's own ``__init__`` is ``(root)``)."""
    name = module.removeprefix("vllm_ascend_routing").removeprefix(".")
    return name.split(".")[0] or "(root)"


def room_graph(graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Which room imports which, every import counted (function-level and ``TYPE_CHECKING`` ones too): the house as
    one reads it from the folders, where a folder is one piece however its modules are layered inside."""
    graph = import_graph(type_checking=True) if graph is None else graph
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        room = room_of(module)
        rooms.setdefault(room, set()).update(room_of(target) for target in targets if room_of(target) != room)
    return rooms


def back_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports that close a circle, one per circle a depth-first walk finds (none: the rooms stand in floors,
    each importing only lower ones)."""
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    found: list[tuple[str, str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                found.append((node, target))
            elif target not in state:
                visit(target)
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "vllm_ascend_routing.runner_state" in graph and graph["vllm_ascend_routing.manifest"]
    assert cycles(graph) == []


def test_no_room_imports_one_that_imports_it_back() -> None:
    """At the scale of rooms (top-level modules and folders), every import counted: no circle. A module may live low
    in one folder's layers and still close a circle between two folders (``kv_transfer`` importing ``compat``, which
    imported it back, did), which the per-module layers below do not see."""
    rooms = room_graph()
    assert {"compat", "kv", "output", "backends"} <= rooms.keys()
    assert back_edges(rooms) == []


def test_the_room_check_finds_a_circle_between_folders() -> None:
    graph = {
        "vllm_ascend_routing.kv.follower": {"vllm_ascend_routing.compat.interface"},
        "vllm_ascend_routing.compat.runner_output.kv_rows": {"vllm_ascend_routing.kv.carriers"},
        "vllm_ascend_routing.kv.carriers": set(),
        "vllm_ascend_routing.compat.interface": set(),
    }
    assert room_graph(graph) == {"kv": {"compat"}, "compat": {"kv"}}
    assert back_edges(room_graph(graph)) == [("kv", "compat")]


def test_the_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_leaf_modules_import_nothing_of_the_package_but_the_release_table() -> None:
    graph = import_graph()
    table = "vllm_ascend_routing.releases"
    assert graph[table] == set()
    assert graph["vllm_ascend_routing.runner_state"] == set()
    assert graph["vllm_ascend_routing.errors"] == set()
    # The package root and compat's package module are imported implicitly with any of their submodules.
    assert graph["vllm_ascend_routing.patching"] <= {table}


# The package's layers, lowest first (a module is placed by its longest matching name; the package's own
# ``__init__`` is ``register()``, wiring). A module may import its own layer or lower ones.
LAYERS: tuple[tuple[str, ...], ...] = (
    # leaves: plain data and state, no package imports
    ("releases", "runner_state", "_logging", "contract", "parallel", "_post_import", "compat.shm.store",
     "ops._id_rule", "ops._reference", "backends._layer", "errors", "reporting", "context"),
    ("envs", "patching"),  # settings; Patch and the one way to patch
    ("ops", "capture", "sentinel", "sleep_mode", "validate", "_cpu_compat", "store", "replay", "kv",  # + row store
     "output.options", "output.weights", "output.provenance"),  # per-request options, weight version, record
    ("backends",),  # where routing is intercepted
    ("compat",),  # the adapter: its interface, detection, and one folder per generation
    ("runner_mixin", "peers", "output"),  # features that hold the adapter: runner hooks, start-up check, output
    ("features", "manifest", "integration", ""),  # wiring: the registry, collect, verify, install; register()
    ("versions", "__main__", "preflight"),  # user-facing tools: doctor, its self-check and pre-flight
)  # fmt: skip


def layer_of(module: str) -> int:
    name = module.removeprefix("vllm_ascend_routing").removeprefix(".")
    best = None
    for index, members in enumerate(LAYERS):
        for member in members:
            matches = name == member or (member and name.startswith(member + "."))
            if matches and (best is None or len(member) > best[1]):
                best = (index, len(member))
    assert best is not None, f"{module} is in no layer of LAYERS: place it"
    return best[0]


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


def test_the_layer_check_finds_an_upward_import() -> None:
    assert layer_of("vllm_ascend_routing.releases") < layer_of("vllm_ascend_routing.manifest")
    assert layer_of("vllm_ascend_routing.backends.ascend") < layer_of("vllm_ascend_routing.compat.interface")
    assert layer_of("vllm_ascend_routing.backends._layer") == 0


def compat_imports_of_backends(graph: dict[str, set[str]], paths: list[Path]) -> dict[str, list[str]]:
    """What each module under ``backends/`` imports of ``compat/`` (at run time, or under ``TYPE_CHECKING``)."""
    compat = "vllm_ascend_routing.compat"
    found: dict[str, list[str]] = {}
    for path in paths:
        module = module_name(path)
        if not module.startswith("vllm_ascend_routing.backends"):
            continue
        names = graph.get(module, set()) | imported_names(path)
        hits = sorted(name for name in names if name == compat or name.startswith(compat + "."))
        if hits:
            found[module] = hits
    return found


def test_the_backends_never_import_the_generations() -> None:
    """The two axes stay apart: a backend (where routing is intercepted) works under every API generation, so
    nothing under ``backends/`` imports ``compat/`` (the errors both raise live in the leaf ``errors``)."""
    paths = sorted(PACKAGE.rglob("*.py"))
    assert any(module_name(path) == "vllm_ascend_routing.backends.ascend_config" for path in paths)
    assert compat_imports_of_backends(import_graph(), paths) == {}


def test_the_axes_check_finds_a_backend_importing_compat() -> None:
    backend = PACKAGE / "backends" / "ascend_config.py"
    graph = {"vllm_ascend_routing.backends.ascend_config": {"vllm_ascend_routing.compat.interface"}}
    assert compat_imports_of_backends(graph, [backend]) == {
        "vllm_ascend_routing.backends.ascend_config": ["vllm_ascend_routing.compat.interface"]
    }


def imported_names(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports, at any depth (``if TYPE_CHECKING:`` blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_the_package_never_imports_the_tests() -> None:
    """The test harness (tests/harness: stand-ins, DP/server/stress scenarios) stays out of the wheel; a runtime
    import of it would fail once installed."""
    offenders = {
        module_name(path): sorted(name for name in imported_names(path) if name == "tests" or name.startswith("tests."))
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert {name: found for name, found in offenders.items() if found} == {}
    assert "tests.harness" in imported_names(
        Path(__file__).resolve().parent / "e2e" / "conftest.py"
    )  # it would see one
