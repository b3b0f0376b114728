# SPDX-License-Identifier: Apache-2.0
"""``scripts/house.py`` (make house): modules and lines per layer of ``tests/test_import_graph.py``'s ``LAYERS``, the
largest module, the imports running up the layers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests import scripts, test_import_graph

house = scripts.load("scripts/house.py", "_house")


def test_every_module_of_the_package_is_counted_once_in_its_layer() -> None:
    measured = house.measure(house.layer_table(house.ROOT))
    paths = sorted(test_import_graph.PACKAGE.rglob("*.py"))
    assert measured.lines == {test_import_graph.module_name(path): len(path.read_text().splitlines()) for path in paths}
    for index, modules in enumerate(measured.modules):
        assert all(test_import_graph.layer_of(module) == index for module, _ in modules)
    assert measured.upward == [] and measured.across == [] and measured.cycles == []  # test_import_graph's too
    assert measured.rooms == test_import_graph.room_graph() and measured.back == []


def test_an_upward_import_and_a_backend_importing_compat_are_found(tmp_path: Path) -> None:
    package = tmp_path / "vllm_ascend_routing"
    package.mkdir()
    (package / "low.py").write_text("import vllm_ascend_routing.high\n")
    (package / "high.py").write_text("x = 1\n" * 600)
    low, high, backend, compat = (f"vllm_ascend_routing.{name}" for name in ("low", "high", "backends.b", "compat.c"))
    layers = {low: 0, high: 1, backend: 1, compat: 0}
    table = SimpleNamespace(
        PACKAGE=package,
        LAYERS=(("low",), ("high",)),
        module_name=lambda path: f"vllm_ascend_routing.{path.stem}",
        import_graph=lambda: {low: {high}, high: set(), backend: {compat}},
        layer_of=layers.__getitem__,
        cycles=lambda graph: [],
        room_graph=lambda: {"low": {"high"}, "high": {"low"}},
        back_edges=test_import_graph.back_edges,
    )
    measured = house.measure(table)
    assert measured.modules == [[(low, 1)], [(high, 600)]]
    assert measured.upward == [f"{low} (layer 0) imports {high} (layer 1)"]
    assert measured.across == [f"{backend} imports {compat}"]
    assert measured.back == [("low", "high")]


def test_the_report_prints_the_totals() -> None:
    lines = house.report(house.ROOT, summary=True)
    assert lines[0].startswith("house of ") and lines[1].startswith("layer 0 [releases, ")
    assert any(line.startswith("modules: ") and "largest: " in line for line in lines)
    assert "imports running up the layers: 0" in lines and "import cycles: 0" in lines
    assert "backends importing compat: 0" in lines
    assert any(
        line.startswith("rooms (") and line.endswith("imports running back up (closing a circle of rooms): 0")
        for line in lines
    )
