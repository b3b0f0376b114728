#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The package's house, measured: per layer of ``tests/test_import_graph.py``'s ``LAYERS`` (the table itself,
imported), its modules and their line counts; then the largest module, the modules over the house limit, the
imports running up the layers, the backends importing ``compat`` (the two axes), and the import cycles.

    python3 scripts/house.py [--root CHECKOUT] [--summary]

``--root``: another checkout (a worktree of an older commit, for a before/after), measured with its own
``tests/test_import_graph.py`` and package. ``--summary``: one line per layer instead of every module. Standard
library only (the package's ``releases`` table, which the layer table reads, is one).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "vllm_ascend_routing"
LIMIT = 500  # lines per module (docs/development.md, "no module over 500 lines")


def layer_table(root: Path) -> ModuleType:
    """``root``'s ``tests/test_import_graph.py``, imported with ``root`` first on the path (its package)."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    imported = sys.modules.get("vllm_ascend_routing")
    if imported is not None and not Path(str(imported.__file__)).resolve().is_relative_to(root):
        for name in [name for name in sys.modules if name.split(".")[0] == "vllm_ascend_routing"]:
            del sys.modules[name]  # imported from another checkout: it would be measured instead
    spec = importlib.util.spec_from_file_location("_house_import_graph", root / "tests" / "test_import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def commit_of(root: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        return "not a git checkout"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root).returncode != 0
    return done.stdout.strip() + (" + changes" if dirty else "")


@dataclass
class House:
    layers: tuple[tuple[str, ...], ...]  # LAYERS' members
    modules: list[list[tuple[str, int]]]  # per layer: (module, lines)
    upward: list[str]  # the imports running up the layers
    across: list[str]  # backends/ importing compat/ (the two axes)
    cycles: list[list[str]]
    rooms: dict[str, set[str]]  # top-level module or folder -> the rooms it imports (every import counted)
    back: list[tuple[str, str]]  # imports between rooms that close a circle

    @property
    def lines(self) -> dict[str, int]:
        return {module: count for layer in self.modules for module, count in layer}


def measure(table: Any) -> House:
    """Modules by layer with their lines, the imports running up the layers, the import cycles, as the layer
    table's module (``layer_table``) places and finds them."""
    lines = {
        table.module_name(path): len(path.read_text().splitlines()) for path in sorted(table.PACKAGE.rglob("*.py"))
    }
    graph = table.import_graph()
    modules: list[list[tuple[str, int]]] = [[] for _ in table.LAYERS]
    for module, count in sorted(lines.items()):
        modules[table.layer_of(module)].append((module, count))
    upward = sorted(
        f"{module} (layer {table.layer_of(module)}) imports {target} (layer {table.layer_of(target)})"
        for module, targets in graph.items()
        for target in targets
        if table.layer_of(target) > table.layer_of(module)
    )
    across = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if module.startswith(f"{PACKAGE}.backends") and target.startswith(f"{PACKAGE}.compat")
    )
    rooms = table.room_graph()
    return House(tuple(table.LAYERS), modules, upward, across, table.cycles(graph), rooms, table.back_edges(rooms))


def short(module: str) -> str:
    return module.removeprefix("vllm_ascend_routing").removeprefix(".") or "(package root)"


def report(root: Path, summary: bool) -> list[str]:
    house = measure(layer_table(root))
    lines = house.lines
    out = [f"house of {root} ({commit_of(root)})"]
    for index, modules in enumerate(house.modules):
        members = ", ".join(member or "(package root)" for member in house.layers[index])
        total = sum(count for _, count in modules)
        largest = max(modules, key=lambda item: item[1], default=("-", 0))
        head = f"layer {index} [{members}]: {len(modules)} modules, {total} lines"
        if summary:
            out.append(f"{head}; largest {short(largest[0])} ({largest[1]})")
            continue
        out.append(head)
        out += [f"    {short(module):40s} {count:5d}" for module, count in modules]
    largest_module = max(lines, key=lambda name: lines[name])
    over = sorted(short(name) for name, count in lines.items() if count > LIMIT)
    out.append(
        f"modules: {len(lines)}, lines: {sum(lines.values())}; largest: {short(largest_module)} "
        f"({lines[largest_module]} lines); over {LIMIT} lines: {len(over)}" + (f" ({', '.join(over)})" if over else "")
    )
    out.append(f"imports running up the layers: {len(house.upward)}")
    out += [f"    {line}" for line in house.upward]
    out.append(f"backends importing compat: {len(house.across)}")
    out += [f"    {line}" for line in house.across]
    out.append(f"import cycles: {len(house.cycles)}")
    out += [f"    {' <-> '.join(cycle)}" for cycle in house.cycles]
    arrows = sum(len(targets) for targets in house.rooms.values())
    out.append(
        f"rooms (top-level modules and folders, every import counted): {len(house.rooms)}, {arrows} imports between "
        f"them; imports running back up (closing a circle of rooms): {len(house.back)}"
    )
    out += [f"    {room} imports {target}, which imports it back" for room, target in house.back]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    parser.add_argument("--summary", action="store_true", help="one line per layer")
    args = parser.parse_args(argv)
    print("\n".join(report(args.root.resolve(), args.summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
