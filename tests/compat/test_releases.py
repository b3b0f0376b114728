# SPDX-License-Identifier: Apache-2.0
"""The one release table (``releases.py``): consistent, read by detection, and failing the day an old
generation's path can be deleted (compat tests in the style of vllm-spyre)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import release_roles
from vllm_ascend_routing import manifest, releases
from vllm_ascend_routing.compat import _detect
from vllm_ascend_routing.compat.interface import SUPPORTED_RELEASES
from vllm_ascend_routing.releases import GENERATIONS, version_key

PACKAGE = Path(releases.__file__).parent


def adapter_files(span: releases.GenerationReleases) -> tuple[str, ...]:
    """The generation's folder (its row's ``adapter`` names a class in it): everything only it uses lives there."""
    module = span.adapter.partition(":")[0]
    return (module.removeprefix("vllm_ascend_routing.").replace(".", "/"),)


def test_spans_are_ordered_and_cover_every_listed_release() -> None:
    firsts = [version_key(span.first) for span in GENERATIONS]
    assert firsts == sorted(firsts)
    for span in GENERATIONS:
        assert version_key(span.first) <= version_key(span.last_tested)
    for earlier, later in zip(GENERATIONS, GENERATIONS[1:], strict=False):
        assert version_key(earlier.last_tested) < version_key(later.first)
    for release in (*releases.CPU_RELEASES, *releases.STATIC_RELEASES):
        span = releases.generation_of(release)
        assert span is not None and version_key(release) <= version_key(GENERATIONS[-1].last_tested)
    assert releases.generation_of("0.19.1") is None


# Which generation each release is, written out from vLLM's history (docs/design.md), not from the table.
_SHM, _DEVICE_CACHE, _RUNNER, _AUX = "shm", "device-cache", "runner-output", "aux-output"
KNOWN_GENERATIONS = {
    "0.19.1": None,
    "0.20.0": _SHM, "0.20.1": _SHM, "0.20.2": _SHM, "0.20.2+cpu": _SHM,
    "0.21.0": _DEVICE_CACHE,
    "0.22.0": _RUNNER, "0.22.1": _RUNNER, "0.23.0": _RUNNER, "0.24.0": _RUNNER, "0.25.0": _RUNNER,
    "0.25.1": _RUNNER, "0.26.0": _RUNNER, "0.27.0": _RUNNER, "0.27.1": _RUNNER, "0.28.0": _RUNNER,
    "0.29.0": _RUNNER, "0.30.0": _RUNNER,
    "0.31.0": _AUX, "0.32.0": _AUX, "0.33.0": _AUX, "0.40.0": _AUX,
    "not-a-version": None,
}  # fmt: skip


@pytest.mark.parametrize(("release", "generation"), KNOWN_GENERATIONS.items())
def test_detection_by_version(release: str, generation: str | None) -> None:
    found = _detect._by_version(release)
    assert (None if found is None else found.value) == generation


def test_every_listed_release_has_a_known_generation() -> None:
    assert set(releases.CPU_RELEASES) | set(releases.STATIC_RELEASES) <= set(KNOWN_GENERATIONS)


def test_supported_text_is_derived_from_the_table() -> None:
    expected = "0.20.0-" + GENERATIONS[-1].last_tested  # every generation from 0.20.0 on is served
    assert expected == SUPPORTED_RELEASES
    assert releases.lowest_supported() == "0.20.0"


@pytest.mark.parametrize("span", [span for span in GENERATIONS if span.obsolete_from], ids=lambda s: s.generation.value)
def test_old_generation_is_deleted_once_the_lowest_supported_release_passes_it(
    span: releases.GenerationReleases,
) -> None:
    """Fails the day the lowest supported release reaches ``obsolete_from``: delete the adapter, its manifest
    rows and its table entry (e.g. lowest >= 0.22 -> remove ``compat/shm/``)."""
    lowest = releases.lowest_supported()
    files = adapter_files(span)
    assert all((PACKAGE / name).exists() for name in files)
    assert version_key(lowest) < version_key(span.obsolete_from), (
        f"the lowest supported vLLM is {lowest}: delete {', '.join(files)} and the {span.generation.value} "
        f"rows of the manifest ({span.delete_when})"
    )


def test_every_supported_generation_has_an_adapter_and_manifest_rows() -> None:
    adapters = {api.generation for api in manifest.adapters()}
    assert adapters == {span.generation for span in GENERATIONS if span.supported}
    for generation in adapters:
        assert manifest.patches_for(generation, "cpu")


def test_release_text_of_manifest_rows_comes_from_the_table() -> None:
    rows = {patch.target: patch for patch in manifest.all_patches()}
    binder = rows["vllm.distributed.aux_output_connector.worker:bind_routed_experts_capturer"]
    assert binder.release_text == f"vLLM 0.31.0-{GENERATIONS[-1].last_tested}"


def test_release_roles_name_listed_releases() -> None:
    assert release_roles.FULL_E2E_RELEASE in release_roles.E2E_RELEASES
    assert set(release_roles.CPU_SPEC_BROKEN) <= set(releases.CPU_RELEASES)
    assert not set(release_roles.CPU_SPEC_BROKEN) & set(release_roles.SPEC_RELEASES)  # the spec release must run them


def test_each_generation_declares_the_array_it_returns() -> None:
    """Every served generation names its array's row contract in the table (``row_dtypes``, or its prompt's rows
    apart), which the bridge (``replay.ROW_CONTRACTS``) and ``contract.request_rows`` read; generations sharing a
    dtype share its row convention."""
    for span in releases.implemented():
        assert bool(span.row_dtypes) != bool(span.prompt_rows_field), span.generation
    contracts = releases.row_contracts()
    for span in GENERATIONS:
        for dtype in span.row_dtypes:
            assert contracts[dtype][1] is span.takes_prompt_start, (dtype, span.generation)
    # Written out from vLLM's history (README, "Reading the array"), not from the table.
    assert contracts == {"int32": ("vLLM 0.20.x", False), "uint8": ("vLLM 0.22+", True), "uint16": ("vLLM 0.22+", True)}
    assert releases.prompt_rows_fields() == ("prompt_routed_experts",)
