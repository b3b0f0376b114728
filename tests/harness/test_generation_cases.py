# SPDX-License-Identifier: Apache-2.0
"""Where make test runs the once-per-generation e2e cases: exactly one e2e release per API generation."""

from __future__ import annotations

import pytest

from tests import release_roles, settings
from tests.harness import generation_cases
from vllm_ascend_routing import releases


def test_each_generation_of_the_e2e_releases_runs_its_cases_on_exactly_one() -> None:
    chosen: dict[str, list[str]] = {}
    for release in release_roles.E2E_RELEASES:
        span = releases.generation_of(release)
        assert span is not None
        if generation_cases.runs_here(release):
            chosen.setdefault(span.generation.value, []).append(release)
    generations = {span.generation.value for span in map(releases.generation_of, release_roles.E2E_RELEASES) if span}
    assert set(chosen) == generations and all(len(where) == 1 for where in chosen.values()), chosen
    assert release_roles.FULL_E2E_RELEASE in sum(chosen.values(), [])
    assert not generation_cases.runs_here("0.23.0")  # runner-output: its cases run on 0.30.0


def test_every_release_runs_them_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE", "1")
    assert settings.VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE
    assert all(generation_cases.runs_here(release) for release in release_roles.E2E_RELEASES)


def test_once_runs_on_the_full_release_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE", raising=False)
    for release in release_roles.E2E_RELEASES:
        if release == release_roles.FULL_E2E_RELEASE:
            generation_cases.once("a case", release)  # no skip
        else:
            with pytest.raises(pytest.skip.Exception, match=f"runs once, on {release_roles.FULL_E2E_RELEASE}"):
                generation_cases.once("a case", release)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE", "1")
    generation_cases.once("a case", "0.32.0")
