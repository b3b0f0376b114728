# SPDX-License-Identifier: Apache-2.0
"""``make -n TARGET`` is a dry run: it prints the recipe and builds no environment, installs nothing; bare ``make``
prints the help (the Makefile's ``## `` comments) and builds nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import release_roles

ROOT = Path(__file__).resolve().parent.parent
TARGETS = re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def test_the_makefile_has_its_targets() -> None:
    assert {"test", "lint", "test-unit", "test-e2e", "test-ascend", "demo", "bench", "matrix"} <= set(TARGETS)


def marking_python(tmp_path: Path) -> tuple[Path, Path]:
    """A ``PYTHON`` stand-in that leaves a mark when run; reading the release table (make remakes its variables
    from it before anything else) is the one thing it lets through."""
    mark = tmp_path / "python-ran"
    python = tmp_path / "python"
    python.write_text(
        '#!/bin/sh\ncase "$1" in */release_roles.py|tests/release_roles.py) exec python3 "$@";; esac\n'
        f'echo "$@" >> {mark}\nexit 1\n'
    )
    python.chmod(0o755)
    return python, mark


def test_bare_make_prints_the_help_and_builds_nothing(tmp_path: Path) -> None:
    python, mark = marking_python(tmp_path)
    env = {**os.environ, "VLLM_ASCEND_ROUTING_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        ["make", "--no-print-directory", f"PYTHON={python}"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert not mark.exists() and not (tmp_path / "cache").exists()
    helped = re.findall(r"^make ([a-z][a-z0-9-]*)", done.stdout, flags=re.MULTILINE)
    documented = re.findall(r"^## make ([a-z][a-z0-9-]*)", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert helped == documented and "help" in helped  # every `## make` comment, in the Makefile's order
    undocumented = [t for t in TARGETS if t not in helped and not t.endswith("-%") and t != "e2e-"]
    assert undocumented == [], f"targets without a `## make TARGET: ...` comment (make help): {undocumented}"


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "clean-venvs"])
def test_dry_run_runs_no_python(target: str, tmp_path: Path) -> None:
    """``PYTHON`` is a stand-in that leaves a mark when run: a dry run must only print its commands."""
    python, mark = marking_python(tmp_path)
    env = {**os.environ, "VLLM_ASCEND_ROUTING_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", target, f"PYTHON={python}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()  # the recipe was printed
    assert not mark.exists(), f"make -n {target} ran: {mark.read_text()}"
    assert not (tmp_path / "cache").exists()


def test_make_test_queues_every_stage_the_ci_workflow_runs() -> None:
    """``make test``'s one queue (scripts/lanes.py) holds every make target a job of the fork CI workflow runs, the
    Ascend and e2e releases of the release table included, and lint: none is left out of the test command."""
    from tests import scripts

    workflow = scripts.load("scripts/workflow.py", "_workflow_for_make_test")
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    recipe = done.stdout.replace("\\\n", " ")  # the recipe's continued lines as the shell runs them
    (line,) = [line for line in recipe.splitlines() if "scripts/lanes.py" in line]
    queued = line.split("scripts/lanes.py", 1)[1].split()
    assert "--history" in queued
    apart = queued[queued.index("--apart") + 1].strip('"').split(",")
    assert apart == ["e2e-0.20.2", "ascend-0.20.2rc1"]  # vLLM 0.20.x's shared-memory store: one stage at a time
    stages = {word for word in queued if not word.startswith("-") and not {"/", ",", '"'} & set(word)}
    stages -= {word for word in stages if word.isdigit()}
    wanted = {
        target for entry in workflow.jobs(release_roles, workflow.trainer_pythons()) for target in entry["make"].split()
    }
    assert wanted <= stages, wanted - stages
    assert {f"e2e-{release}" for release in release_roles.E2E_RELEASES} <= stages
    assert {f"ascend-{release}" for release in release_roles.ASCEND_TEST_RELEASES} <= stages
