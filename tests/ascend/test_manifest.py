# SPDX-License-Identifier: Apache-2.0
"""Every patch target the plugin needs in this vllm-ascend release exists with the expected parameters;
a renamed one is refused at start-up with its name."""

from __future__ import annotations

import importlib

import pytest

from vllm_ascend_routing import manifest
from vllm_ascend_routing.compat import get_api
from vllm_ascend_routing.compat.base import UnsupportedVllmError

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]


def ascend_patches() -> list[manifest.Patch]:
    return [p for p in manifest.patches_for(get_api().generation, "npu") if p.target.startswith("vllm_ascend")]


def test_every_patch_target_exists_with_expected_parameters() -> None:
    patches = ascend_patches()
    assert any(p.target.endswith("select_experts") for p in patches)
    problems = {p.target: manifest.problem(p) for p in patches}
    assert {target: found for target, found in problems.items() if found} == {}
    manifest.verify(get_api().generation, "npu", "vllm_ascend")  # what start-up runs


def test_required_targets_resolve_to_real_objects() -> None:
    for patch in ascend_patches():
        if patch.required:
            assert manifest.resolve(patch.target) is not None, patch.target


def test_a_renamed_target_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    selector = importlib.import_module("vllm_ascend.ops.fused_moe.experts_selector")
    monkeypatch.delattr(selector, "select_experts")  # what a future release renaming it looks like
    with pytest.raises(UnsupportedVllmError) as refused:
        manifest.verify(get_api().generation, "npu", "vllm_ascend")
    message = str(refused.value)
    assert "vllm_ascend.ops.fused_moe.experts_selector has no select_experts" in message
    assert "vllm_ascend" in message and "not supported yet" in message


def test_a_changed_signature_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    selector = importlib.import_module("vllm_ascend.ops.fused_moe.experts_selector")
    monkeypatch.setattr(selector, "select_experts", lambda hidden, logits, k: None)
    with pytest.raises(UnsupportedVllmError, match="lacks parameter"):
        manifest.verify(get_api().generation, "npu", "vllm_ascend")
