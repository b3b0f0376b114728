# SPDX-License-Identifier: Apache-2.0
"""The runtime wheel holds the plugin and what its commands run (doctor, demo, replay-check: ``preflight``), and
nothing of the test harness: no ``sitecustomize.py`` stand-in, no ``tests/`` or ``testing/`` path, no harness module.

The wheel is built once from a copy of the checkout (the pure-Python build: ``VLLM_ASCEND_ROUTING_TARGET_DEVICE``
unset), so the checkout gets no ``build/`` or ``*.egg-info``; then every module in it is imported from the
unpacked wheel alone, outside the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.test_import_graph import imported_names

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "harness"
# What doctor, demo, replay-check and doctor --model run, beyond the plugin itself.
COMMANDS = ["__main__", "versions"]
PREFLIGHT = ["__init__", "doctor", "model_check", "models", "reference", "compare", "offline", "scenarios"]
PREFLIGHT += ["replay_check", "trainer"]
PREFLIGHT += ["consistency", "reprefill", "engine_flags", "frontend"]  # doctor --model's oracle and engine flags
# Split between the two: doctor's offline scenario is runtime (preflight), the test suite's others the harness's.
SHARED_NAMES = {"scenarios"}
# Not the build's inputs: caches, earlier builds, local models.
NOT_SOURCES = shutil.ignore_patterns(
    ".git", "__pycache__", "build", "dist", "*.egg-info", ".*_cache", "models", "*.so", "*.whl"
)


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the checkout, unpacked (its file list: ``RECORD`` aside, its files)."""
    scratch = tmp_path_factory.mktemp("wheel")
    source = scratch / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_ROUTING_TARGET_DEVICE"}  # no kernel build
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")  # nothing to fetch: no deps, no isolation
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(scratch), "."]
    done = subprocess.run(cmd, cwd=source, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = scratch.glob("vllm_ascend_routing-*.whl")
    target = scratch / "unpacked"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def files(unpacked: Path) -> list[str]:
    return sorted(path.relative_to(unpacked).as_posix() for path in unpacked.rglob("*") if path.is_file())


def harness_names() -> set[str]:
    """The harness's module and stand-in folder names (the split scenarios module aside)."""
    modules = {
        path.stem for path in HARNESS.glob("*.py") if path.stem != "__init__" and not path.stem.startswith("test_")
    }
    folders = {path.name for path in HARNESS.iterdir() if path.is_dir() and path.name.endswith("_standin")}
    return (modules | folders) - SHARED_NAMES


def test_the_harness_is_where_the_rule_reads_it() -> None:
    # The rule below reads tests/harness: it must find the stand-ins and the harness there to mean anything.
    assert {"cpu_dp_collectives", "data_parallel", "bypass", "stress", "dp_standin", "no_amx_standin"} <= (
        harness_names()
    )


def test_no_stand_in_or_test_harness_in_the_wheel(unpacked: Path) -> None:
    forbidden = harness_names()
    found = [
        name
        for name in files(unpacked)
        if Path(name).name == "sitecustomize.py"
        or {"tests", "testing"} & set(Path(name).parts[:-1])
        or Path(name).stem in forbidden
        or forbidden & set(Path(name).parts[:-1])
    ]
    assert found == []
    assert all(name.startswith(("vllm_ascend_routing/", "vllm_ascend_routing-")) for name in files(unpacked))


def test_what_the_commands_run_is_in_the_wheel(unpacked: Path) -> None:
    expected = [f"vllm_ascend_routing/{name}.py" for name in COMMANDS]
    expected += [f"vllm_ascend_routing/preflight/{name}.py" for name in PREFLIGHT]
    expected.append("vllm_ascend_routing/py.typed")
    assert [name for name in expected if name not in files(unpacked)] == []
    (entry_points,) = unpacked.glob("*.dist-info/entry_points.txt")
    assert "vllm_ascend_routing = vllm_ascend_routing:register" in entry_points.read_text()


def package_imports(path: Path) -> set[str]:
    """Absolute module names of the package and of the checkout's tests that ``path`` imports, at any depth."""
    return {name for name in imported_names(path) if name.split(".")[0] in ("vllm_ascend_routing", "tests")}


def test_every_module_the_wheel_imports_is_in_it(unpacked: Path) -> None:
    """Each ``vllm_ascend_routing.*`` module a wheel module names (function-level imports included) is a module
    or package of the wheel; none names the tests."""
    modules = {
        ".".join(path.relative_to(unpacked).with_suffix("").parts).removesuffix(".__init__")
        for path in unpacked.rglob("*.py")
    }
    missing = {
        path.relative_to(unpacked).as_posix(): sorted(package_imports(path) - modules)
        for path in sorted(unpacked.rglob("*.py"))
    }
    assert {name: found for name, found in missing.items() if found} == {}


def test_the_unpacked_wheel_alone_imports_and_runs_its_commands(unpacked: Path, tmp_path: Path) -> None:
    """Every module imported from the unpacked wheel (outside the checkout: no ``tests`` importable beside it),
    then the command line's help for each command."""
    code = (
        "import importlib, pkgutil, sys, vllm_ascend_routing\n"
        "for module in pkgutil.walk_packages(vllm_ascend_routing.__path__, 'vllm_ascend_routing.'):\n"
        "    importlib.import_module(module.name)\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('vllm_ascend_routing', 'tests')]\n"
        "print(sorted({getattr(sys.modules[m], '__file__', None) is not None and "
        f"sys.modules[m].__file__.startswith({str(unpacked)!r}) for m in loaded}}))\n"
        "print(sorted(m for m in loaded if m.split('.')[0] == 'tests'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-2:] == ["[True]", "[]"]  # all from the wheel; no tests module
    for command in ("doctor", "demo", "replay-check"):
        done = subprocess.run(
            [sys.executable, "-m", "vllm_ascend_routing", command, "--help"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-3000:]
