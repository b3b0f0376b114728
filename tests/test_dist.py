# SPDX-License-Identifier: Apache-2.0
"""``make dist`` (scripts/dist.py) and the offline install it is for: the sdist and the ``py3-none-any`` wheel carry
the version in their names, the license and the commit they were built from; the wheel installs with
``pip install --no-index --no-deps`` into a fresh virtual environment (no site packages of this one), where
``--version`` names the build's commit and vLLM finds the plugin's entry point.

Built from a copy of the checkout made a git repository of its own (the build-time commit is then known),
as tests/test_wheel.py copies it, so the checkout gets no ``build/``, ``dist/`` or ``*.egg-info``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.test_wheel import NOT_SOURCES, ROOT
from vllm_ascend_routing import __version__

GIT = shutil.which("git")
pytestmark = pytest.mark.skipif(GIT is None, reason="git is not installed (the build-time commit needs it)")


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cmd}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """``(sdist, wheel, commit)``: ``scripts/dist.py`` run in a committed copy of the checkout."""
    scratch = tmp_path_factory.mktemp("dist")
    source = scratch / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    assert GIT is not None
    run([GIT, "init", "-q"], source)
    run([GIT, "add", "-A"], source)
    run([GIT, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "snapshot"], source)
    commit = run([GIT, "rev-parse", "HEAD"], source).strip()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_ROUTING_TARGET_DEVICE"}
    printed = run([sys.executable, "scripts/dist.py", "--out", str(scratch / "dist")], source, env).split()
    sdist, wheel = (Path(line) for line in printed[-2:])
    return sdist, wheel, commit


def test_the_names_carry_the_version_and_the_wheel_is_pure_python(built: tuple[Path, Path, str]) -> None:
    sdist, wheel, _ = built
    assert sdist.name == f"vllm_ascend_routing-{__version__}.tar.gz"
    assert wheel.name == f"vllm_ascend_routing-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert not [name for name in names if name.endswith((".so", ".pyd"))]


def test_both_carry_the_license_and_the_commit(built: tuple[Path, Path, str]) -> None:
    sdist, wheel, commit = built
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = json.loads(archive.read("vllm_ascend_routing/_build_info.json"))
        licenses = [name for name in names if ".dist-info/" in name and name.endswith("LICENSE")]
        assert licenses and b"Apache License" in archive.read(licenses[0])
    assert info == {"commit": commit}
    top = f"vllm_ascend_routing-{__version__}/"
    with tarfile.open(sdist) as archive:
        members = {name.removeprefix(top) for name in archive.getnames()}
        sdist_info = archive.extractfile(top + "vllm_ascend_routing/_build_info.json")
        assert sdist_info is not None and json.loads(sdist_info.read()) == {"commit": commit}
    # What a native source build needs (docs/kernels.md), and the notices; no partial copy of the test suite.
    assert {"LICENSE", "CHANGELOG.md", "CMakeLists.txt", "csrc/module.cpp", "setup.py", "pyproject.toml"} <= members
    assert not [name for name in members if name.startswith("tests/")]


def test_the_wheel_installs_offline_into_a_fresh_environment(built: tuple[Path, Path, str], tmp_path: Path) -> None:
    _, wheel, commit = built
    venv = tmp_path / "fresh"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path)  # its own site-packages only
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_FIND_LINKS", "PIP_INDEX_URL")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1")
    run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)], tmp_path, env)
    line = run([python, "-m", "vllm_ascend_routing", "--version"], tmp_path, env).strip()
    assert line == f"vllm-ascend-routing {__version__} (commit {commit[:12]}, from the build)"
    code = (
        "import importlib.metadata as m, vllm_ascend_routing as p\n"
        "print(p.__file__)\n"
        "print([e.value for e in m.entry_points(group='vllm.general_plugins')])\n"
        "p.register()\n"  # switched off (no VLLM_ASCEND_ROUTING): imports nothing it lacks, vLLM included
    )
    where, entry = run([python, "-c", code], tmp_path, env).splitlines()
    assert where.startswith(str(venv)) and entry == "['vllm_ascend_routing:register']"
