# SPDX-License-Identifier: Apache-2.0
"""Every patch target the plugin needs in this vllm-ascend release exists with the expected parameters;
the routing seam renamed (select_experts, or AscendRoutedExperts._select_experts in the router design) is
refused at start-up with its name."""

from __future__ import annotations

import importlib

import pytest

from tests.ascend import real_moe
from tests.ascend.conftest import ASCEND_SRC
from vllm_ascend_routing import manifest
from vllm_ascend_routing.backends import ascend_router
from vllm_ascend_routing.compat import adapter as get_adapter
from vllm_ascend_routing.compat.interface import UnsupportedVllmError

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

DESIGN = real_moe.design() if ASCEND_SRC else ""


def ascend_patches() -> list[manifest.Patch]:
    return [p for p in manifest.patches_for(get_adapter().generation, "npu") if p.target.startswith("vllm_ascend")]


def seam() -> tuple[object, str]:
    """The object holding this design's routing seam, and the seam's name."""
    if DESIGN == "router":
        return importlib.import_module(real_moe.ROUTED_EXPERTS).AscendRoutedExperts, "_select_experts"
    return importlib.import_module(real_moe.SELECTOR), "select_experts"


def test_every_patch_target_exists_with_expected_parameters() -> None:
    patches = ascend_patches()
    present = [p.target for p in patches if manifest.problem(p) is None and manifest._present(p)]
    assert any(target.endswith(seam()[1]) for target in present), present
    problems = {p.target: manifest.problem(p) for p in patches}
    assert {target: found for target, found in problems.items() if found} == {}
    findings = manifest.verify(get_adapter().generation, "npu", "vllm_ascend")  # what start-up runs
    # This design's forward (the MoE forward the guard wraps) is present.
    forwards = {"layer": "AscendFusedMoE.forward_impl", "runner": "AscendMoERunner._forward_impl"}
    wanted = forwards.get(DESIGN, "AscendRoutedExperts.forward_impl")
    assert any(f.present and f.patch.target.endswith(wanted) for f in findings)


def test_required_targets_resolve_to_real_objects() -> None:
    for patch in ascend_patches():
        if patch.required:
            assert manifest.resolve(patch.target) is not None, patch.target


def test_a_renamed_seam_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name = seam()
    monkeypatch.delattr(owner, name)  # what a future release renaming it looks like
    with pytest.raises(UnsupportedVllmError) as refused:
        manifest.verify(get_adapter().generation, "npu", "vllm_ascend")
    message = str(refused.value)
    assert "vllm-ascend's routing seam: none of" in message
    assert "experts_selector:select_experts" in message
    if get_adapter().generation in ascend_router.ROUTED_SELECT.generations:  # where the router design can exist
        assert "AscendRoutedExperts._select_experts" in message
    assert "not supported yet" in message


def test_a_changed_signature_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name = seam()
    monkeypatch.setattr(owner, name, lambda hidden, logits, k: None)
    with pytest.raises(UnsupportedVllmError, match="lacks parameter"):
        manifest.verify(get_adapter().generation, "npu", "vllm_ascend")
