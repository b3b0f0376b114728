# SPDX-License-Identifier: Apache-2.0
"""The always-on check (``sentinel``) catches bypasses no hook can see, with validation mode off: an engine
where one MoE layer's hook is removed, and an xlite-style runner that never calls the MoE forward's Python
(``tests/harness/bypass.py``, test-only stand-ins)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import distributed
from tests.harness.bypass import REMOVED_LAYER
from tests.harness.generation_cases import once_per_generation

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def test_a_removed_hook_is_reported_with_request_layer_and_row(scenario: Any) -> None:
    result = scenario("bypass", "--bypass", "removed-hook")
    assert result["zero_layers_returned"] == [REMOVED_LAYER], "the bypass must be real: vLLM returns zeros there"
    stats = result["stats"]
    # Exactly the removed layer's rows, every step: one of the bound layers.
    assert stats["zero_rows"] * len(result["moe_layers"]) == stats["rows_checked"] > 0, stats
    first = result["reports"][0]
    assert "first: request " in first, first
    assert f"layer {REMOVED_LAYER}." in first and "(step row 0)" in first, first


def test_an_xlite_style_runner_is_reported(scenario: Any) -> None:
    # No MoE Python runs at all, so the MoE capture path does not matter: only the generation's step check.
    once_per_generation("the xlite-style bypass", distributed.vllm_release())
    result = scenario("bypass", "--bypass", "xlite")
    assert result["zero_layers_returned"] == result["moe_layers"], "no MoE Python ran: every layer returns zeros"
    stats = result["stats"]
    assert stats["zero_rows"] == stats["rows_checked"] > 0, stats
    assert f"layer {result['moe_layers'][0]}." in result["reports"][0], result["reports"][0]
    assert all(len(ids) == 4 for ids in result["output_ids"]), "the bypassed engine still served tokens"
