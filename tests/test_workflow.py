# SPDX-License-Identifier: Apache-2.0
"""``scripts/workflow.py``: the committed CI workflow for forks (``.github/workflows/ci.yml``) is the one it writes
from the release table, with one job per release role, each running an existing make target."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import release_roles, scripts

workflow = scripts.load("scripts/workflow.py", "_workflow_script")


def test_the_committed_workflow_is_the_generated_one() -> None:
    assert workflow.WORKFLOW.read_text() == workflow.generate(), "run python3 scripts/workflow.py"
    assert workflow.main(["--check"]) == 0


def test_check_fails_on_a_stale_workflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "ci.yml"
    monkeypatch.setattr(workflow, "WORKFLOW", stale)
    assert workflow.main(["--check"]) == 1  # missing
    stale.write_text(workflow.generate().replace("e2e-0.23.0", "e2e-0.22.0"))
    assert workflow.main(["--check"]) == 1
    assert workflow.main([]) == 0 and workflow.main(["--check"]) == 0  # rewritten


def test_one_job_per_release_role() -> None:
    entries = workflow.jobs(release_roles, workflow.trainer_pythons())
    names = [entry["name"] for entry in entries]
    assert names == [
        "lint-unit-native",
        *(f"e2e-{release}" for release in release_roles.E2E_RELEASES),
        *(f"ascend-{release}" for release in release_roles.ASCEND_TEST_RELEASES),
        "test-spec",
        "test-static",
        "test-contract",
        "test-trainer",
    ]
    assert len({entry["cache"] for entry in entries}) == len(entries)  # two jobs saving one cache key would race
    text = workflow.WORKFLOW.read_text()
    assert text.count("          - name: ") == len(entries)
    for name in names:
        assert f'- name: "{name}"' in text


def test_each_job_runs_a_make_target_the_makefile_has() -> None:
    makefile = (scripts.ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.%-]+):", makefile, re.MULTILINE))
    for entry in workflow.jobs(release_roles, workflow.trainer_pythons()):
        for target in entry["make"].split():
            pattern = re.sub(r"-[\d.]+(rc\d+|\.post\d+)?$", "-%", target)
            assert target in targets or pattern in targets, target


def test_trainer_jobs_get_the_pythons_trainer_environments_need() -> None:
    venv = scripts.load("scripts/venv.py", "_venv_script_for_workflow")
    needed = {version for version, _ in venv.TRAINER_ENVS.values()}
    for entry in workflow.jobs(release_roles, workflow.trainer_pythons()):
        pythons = entry["python"].split("\n")
        assert pythons[-1] == workflow.PYTHON  # the last one is the default python3 make runs
        if entry["make"].startswith(("e2e-", "test-trainer")):
            assert needed <= set(pythons)
        else:
            assert pythons == [workflow.PYTHON]


def test_the_workflow_names_no_package_index() -> None:
    text = workflow.WORKFLOW.read_text() + (scripts.ROOT / "scripts" / "workflow.py").read_text()
    assert "://" not in text and "index-url" not in text
