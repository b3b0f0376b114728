# SPDX-License-Identifier: Apache-2.0
"""The one release table (``releases.py``): consistent, read by detection, and failing the day an old
generation's path can be deleted (compat tests in the style of vllm-spyre)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_ascend_routing import manifest, releases
from vllm_ascend_routing.compat import _detect
from vllm_ascend_routing.compat.base import SUPPORTED_RELEASES
from vllm_ascend_routing.releases import GENERATIONS, Generation, version_key

PACKAGE = Path(releases.__file__).parent
# Modules only a generation's own module uses, deleted with it.
PRIVATE_MODULES = {Generation.SHM: ("compat/_shm_store.py",)}


def adapter_files(span: releases.GenerationReleases) -> tuple[str, ...]:
    """The generation's module (its row's ``adapter``) and the modules only it uses."""
    own = span.adapter.removeprefix("vllm_ascend_routing.").replace(".", "/") + ".py"
    return (own, *PRIVATE_MODULES.get(span.generation, ()))


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


@pytest.mark.parametrize("release", releases.CPU_RELEASES)
def test_detection_by_version_is_the_table(release: str) -> None:
    span = releases.generation_of(release)
    assert span is not None and _detect._by_version(release) is span.generation


def test_supported_text_is_derived_from_the_table() -> None:
    expected = "0.20.0-" + GENERATIONS[-1].last_tested  # every generation from 0.20.0 on is served
    assert expected == SUPPORTED_RELEASES
    assert releases.lowest_supported() == "0.20.0"


@pytest.mark.parametrize("span", [span for span in GENERATIONS if span.obsolete_from], ids=lambda s: s.generation.value)
def test_old_generation_is_deleted_once_the_lowest_supported_release_passes_it(
    span: releases.GenerationReleases,
) -> None:
    """Fails the day the lowest supported release reaches ``obsolete_from``: delete the adapter, its manifest
    rows and its table entry (e.g. lowest >= 0.22 -> remove ``compat/shm.py``)."""
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
