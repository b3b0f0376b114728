# SPDX-License-Identifier: Apache-2.0
"""Prefill/decode disaggregation through vLLM's ExampleConnector (shared-storage KV), plugin on: producer,
kv_both and consumer engines in one scenario process (tests/harness/disaggregation.py); every row against the
transformers reference, every decode request against a single engine's request and the re-prefill oracle.

vLLM alone returns, for tokens whose KV was loaded, zeros on a fresh decode engine and other requests' rows once
its slots were used: both cases run here (``consumer_fresh``; ``consumer_after_warm_up``, ``kv_both``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import disaggregation as pd
from tests.harness import distributed
from tests.harness.generation_cases import once_per_generation

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

ARCH = "qwen3_moe_dense"  # a dense layer: its rows travel (as zeros) too


def stored(length: int) -> int:
    """Prompt tokens ExampleConnector stores for a prompt (its whole blocks before the last token)."""
    return (length - 1) // pd.BLOCK_SIZE * pd.BLOCK_SIZE


# Rows each decode request loads: its prompt is the prefill prompt and one token; the KV stored for the prefill
# prompt is what it finds.
LOADED = {
    name: sum(stored(n) for n in lengths) for name, lengths in (("A", pd.SET_A), ("B", pd.SET_B[:-1]), ("C", pd.SET_C))
}


@pytest.fixture(scope="module")
def result(scenario: Any, generation: str) -> dict[str, Any]:
    """One scenario process per generation (about two minutes): runner-output on its full release only (its
    slot-buffer path is one for 0.22-0.30), aux-output on its release, the refusing generations too."""
    once_per_generation("the P/D scenario", distributed.vllm_release())
    return dict(scenario("disaggregation", "--arch", ARCH))


def exact(name: str, phase: dict[str, Any]) -> None:
    assert phase["ok"] and phase["rows"] == phase["matched"] > 0, (name, phase["problems"])


def test_rows_of_loaded_tokens_are_exact_on_every_role(result: dict[str, Any], generation: str) -> None:
    if "phases" not in result:
        pytest.skip(f"vLLM's '{generation}' generation refuses KV connectors (test_refused_where_not_carried)")
    phases = result["phases"]
    for name, phase in phases.items():
        exact(name, phase)
    assert phases["producer"]["rows_stored"] == sum(stored(n) for n in (*pd.SET_A, *pd.SET_B))
    assert result["storage_rows_files"] == sum(stored(n) > 0 for n in (*pd.SET_A, *pd.SET_B))
    assert phases["kv_both_computes"]["rows_loaded"] == 0 and phases["kv_both_computes"]["rows_stored"] > 0
    assert phases["kv_both_loads_after_use"]["rows_loaded"] == LOADED["A"]  # into slots set C used before
    assert phases["consumer_fresh"]["rows_loaded"] == LOADED["A"]  # zeros without the plugin
    assert phases["consumer_warm_up"]["rows_loaded"] == 0
    assert phases["consumer_after_warm_up"]["rows_loaded"] == LOADED["B"]  # stale rows without the plugin
    assert phases["consumer_loads_kv_both"]["rows_loaded"] == LOADED["C"]  # stored by the kv_both engine
    for name, phase in phases.items():  # each request's routed_experts_info counts the rows its KV hand-over loaded
        assert None not in phase["info_loaded"] and sum(phase["info_loaded"]) == phase["rows_loaded"], (name, phase)
    for engine in ("sentinel_producer", "sentinel_kv_both", "sentinel_consumer", "sentinel_tier"):
        checked = result[engine]
        assert checked["rows_checked"] > 0 and checked["zero_rows"] == checked["invalid_ids"] == 0, (engine, checked)
    print(
        f"{generation}: "
        + "; ".join(f"{name} {p['matched']}/{p['rows']} exact, {p['rows_loaded']} loaded" for name, p in phases.items())
    )


def test_a_decode_request_equals_one_engine_and_the_oracle(result: dict[str, Any]) -> None:
    if "phases" not in result:
        pytest.skip("KV connectors refused on this generation")
    for name, against in result["single"].items():
        assert against["same_tokens"] == against["same_rows"] == against["requests"], (name, against)
    oracle = result["oracle"]
    assert oracle["verdict"] == "PASS" and oracle["wrong"] == 0 and oracle["cached_tokens"] == 0, oracle


def test_kv_without_rows_is_computed_here_and_reported(result: dict[str, Any]) -> None:
    """Set B's longest prompt: its KV in the storage, its rows removed (what a producer without the plugin
    leaves): the consumer declines the load, computes the prompt (chunked) and names request and tokens."""
    if "phases" not in result:
        pytest.skip("KV connectors refused on this generation")
    assert result["removed_rows_file"]
    declined = stored(pd.SET_B[-1])
    assert result["phases"]["consumer_after_warm_up"]["rows_declined"] == declined
    assert any(
        f"offers the KV of tokens [0, {declined})" in text and "no routing rows are stored beside that KV" in text
        for text in result["reports"]
    ), result["reports"]


def test_a_connector_without_a_carrier_loads_only_kv_computed_here(result: dict[str, Any], generation: str) -> None:
    """An offload tier or cache service (TEST-ONLY stand-in, tests/harness/local_tier_standin.py): set C's KV,
    stored by the kv_both engine, is computed again here (its rows are not held on this instance); then set C's
    decode requests load the KV this engine stored, with the rows its scheduler held; after vLLM's prefix-cache
    reset (a weight update) they are computed again. Every row exact (above)."""
    if "phases" not in result:
        pytest.skip("KV connectors refused on this generation")
    phases = result["phases"]
    computes, reloads = phases["tier_computes_kv_stored_elsewhere"], phases["tier_reloads_its_own_kv"]
    assert computes["rows_loaded"] == 0 and computes["rows_declined"] == LOADED["C"], computes
    assert reloads["rows_loaded"] == LOADED["C"] and reloads["rows_declined"] == 0, reloads
    assert reloads["cached_tokens"] == [stored(n + 1) for n in pd.SET_C], reloads  # loaded, not a local hit
    assert result["single"]["C_tier"]["same_rows"] == len(pd.SET_C), result["single"]
    held = result["tier_held"]  # what the scheduler holds, against the arrays the engine returned
    assert held["prompt_held"] == held["requests"] == len(pd.SET_C), held
    whole = held["requests"] if generation == "runner-output" else 0  # 0.31+ holds prompts only
    assert held["whole_sequence_held"] == whole, held
    reset = phases["tier_after_prefix_cache_reset"]
    assert reset["rows_loaded"] == 0 and reset["rows_declined"] == LOADED["C"], reset


def test_an_uncovered_connector_is_refused_by_name(result: dict[str, Any], generation: str) -> None:
    if "uncovered" not in result:
        pytest.skip("KV connectors refused on this generation")
    refused = result["uncovered"]
    assert refused["refused"] and "NixlPushConnector" in refused["message"], refused
    if generation == "runner-output":  # the plugin's message at vLLM's own check
        assert "is not covered" in refused["message"] and "remove --kv-transfer-config" in refused["message"]
    print(f"{generation}: {refused['error']}: {refused['message'][-400:]}")


def test_refused_where_not_carried(result: dict[str, Any], generation: str) -> None:
    if "covered" not in result:
        pytest.skip(f"'{generation}' carries rows with KV connectors")
    refused = result["covered"]
    assert refused["refused"] and "served from vLLM 0.22 on" in refused["message"], refused
    print(f"{generation}: {refused['message'][-400:]}")
