# SPDX-License-Identifier: Apache-2.0
"""A new vLLM API generation is its adapter (a folder of ``compat/``) and one release-table row: with only those two
(a test module, ``fake_generation``, and a row added to ``releases.GENERATIONS``), detection, ``envs``,
``compat.adapter``, the patch manifest and the runner hooks all serve it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from tests.compat import fake_generation
from vllm_ascend_routing import envs, manifest, releases, runner_mixin
from vllm_ascend_routing.compat import _detect
from vllm_ascend_routing.compat import adapter as get_adapter
from vllm_ascend_routing.releases import GenerationReleases

FAKE = fake_generation.FakeGeneration.FAKE


@pytest.fixture
def fake_row(monkeypatch: pytest.MonkeyPatch) -> Iterator[GenerationReleases]:
    row = GenerationReleases(
        FAKE,  # type: ignore[arg-type]
        "9.0.0",
        "9.0.0",
        True,
        "never",
        adapter="tests.compat.fake_generation:FakeAdapter",
        markers=("json:dumps", "!json:no_such_symbol"),
    )
    monkeypatch.setattr(releases, "GENERATIONS", (*releases.GENERATIONS, row))
    get_adapter.cache_clear()
    yield row
    get_adapter.cache_clear()


def test_the_row_and_module_are_all_a_generation_needs(
    fake_row: GenerationReleases, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert releases.implemented()[-1] is fake_row
    assert _detect._by_features() is FAKE  # its markers hold here, and detection tries the newest row first
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VLLM_API", FAKE.value)  # envs accepts the table's new name
    assert FAKE.value == envs.VLLM_ASCEND_ROUTING_VLLM_API
    api = get_adapter()
    assert isinstance(api, fake_generation.FakeAdapter)

    rows = manifest.patches_for(FAKE, "cpu")  # type: ignore[arg-type]
    assert [row.target for row in rows] == ["tests.compat.fake_generation:FakeRunner.load_model", "json:dumps"]
    assert all(finding.present and finding.problem is None for finding in manifest.check(FAKE, "cpu"))  # type: ignore[arg-type]
    assert "cpu" in manifest.platforms()

    runner_mixin.apply_mixin(fake_generation.FakeRunner, api)
    try:
        runner = fake_generation.FakeRunner()
        runner.load_model()
        assert api.prepared == [runner.model]  # type: ignore[attr-defined]
    finally:
        fake_generation.FakeRunner.load_model = runner_mixin.patching.original_of(  # type: ignore[method-assign]
            fake_generation.FakeRunner.load_model
        )


def test_without_its_row_the_generation_does_not_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    get_adapter.cache_clear()
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VLLM_API", FAKE.value)
    with pytest.raises(ValueError, match="expected one of auto, shm, device-cache, runner-output, aux-output"):
        envs.VLLM_ASCEND_ROUTING_VLLM_API  # noqa: B018
    assert all(adapter is not fake_generation.FakeAdapter for adapter in manifest.adapters())


def test_a_marker_that_must_be_absent_rules_a_row_out(
    fake_row: GenerationReleases, monkeypatch: pytest.MonkeyPatch
) -> None:
    ruled_out = dataclasses.replace(fake_row, markers=("json:dumps", "!json:loads"))
    monkeypatch.setattr(releases, "GENERATIONS", (*releases.GENERATIONS[:-1], ruled_out))
    assert _detect._by_features() is not FAKE
