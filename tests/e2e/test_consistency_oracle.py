# SPDX-License-Identifier: Apache-2.0
"""The re-prefill consistency oracle (doctor --model's) on a real engine of this release, float32: every
generation row equals its token's re-prefill row (100%, PASS), and each fault planted in the generation's output
(tests/harness/routing_mutations.py) FAILS naming it; one misfiled row planted inside vLLM's front end while the
engine runs (one request's first decode row carrying the previous token's routing) FAILS naming that request and
token (TOKEN_FAULT: tests/harness/engine_plants.py). No engine of its own: the oracle runs on the offline
scenario's compiled engine after its reference checks (tests/harness/oracle.py), the one test_routed_experts runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.test_routed_experts import NUM_PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


@pytest.fixture(scope="module")
def oracle(scenario: Any) -> dict[str, Any]:
    result = scenario("offline", "--arch", "qwen3_moe_dense", "--mode", "compiled", "--prompts", str(NUM_PROMPTS))
    assert result["batch"]["ok"], result["batch"]  # the same engine's rows were exact against the reference
    return dict(result)


FAULTS = ("decode_late", "swap_requests", "stale_step", "layer_zero", "half_tokens_zero", "dp_interleave")


def test_the_oracle_passes_with_every_row_agreeing(oracle: dict[str, Any]) -> None:
    assert_clean(oracle)


@pytest.mark.parametrize("name", FAULTS)
def test_each_planted_fault_fails_naming_it(oracle: dict[str, Any], name: str) -> None:
    assert_fault_named(oracle, name)


def test_one_row_misfiled_in_the_engine_is_named_by_request_and_token(oracle: dict[str, Any]) -> None:
    assert_engine_plant_named(oracle)


def assert_clean(oracle: dict[str, Any]) -> None:
    """Every generation row agrees with its re-prefill (qwen3_moe_dense: MoE layers 0 and 2, dense layer 1)."""
    clean, work = oracle["consistency"], oracle["workload"]
    print(f"{clean['summary']} ({oracle['oracle_seconds']:.1f} s)")
    for layer in clean["layers"]:
        print(f"layer {layer['layer']}: {layer['exact']}/{layer['rows']} rows, offsets {layer['offsets']}")
    assert clean["ok"] and clean["verdict"] == "PASS", clean["summary"]
    assert clean["exact"] == clean["rows"] > 0 and clean["near_ties"] == 0 and not clean["shape_problems"]
    assert clean["token_faults"] == []
    assert [layer["layer"] for layer in clean["layers"]] == [0, 2] and clean["dense_layers"] == [1]
    # What the workload exercised: prefix-cache hits in the generation, none in the re-prefill, chunked prefills.
    assert work["cached_tokens"] > 0 and work["reprefill_cached_tokens"] == 0 and not work["problems"]
    assert work["longest_prompt"] > 128  # > the scenario's max_num_batched_tokens: prefilled in chunks
    assert work["chunked_prefills"] >= 2 and work["layout"]["max_num_batched_tokens"] == 128


def assert_engine_plant_named(oracle: dict[str, Any]) -> None:
    """The plant's request and row (its first decode row: row = prompt length) are the one token the oracle names,
    late (the previous token's rows) in every MoE layer; nothing else fails."""
    plant = oracle["engine_plant"]
    print(f"engine plant: request {plant['request']} row {plant['row']}: {plant['summary']} ({plant['seconds']:.1f} s)")
    assert plant["request"] is not None and plant["row"] is not None, plant
    assert plant["verdict"] == "TOKEN_FAULT", plant["summary"]
    (fault,) = plant["token_faults"]
    assert (fault["request"], fault["row"], fault["kind"]) == (plant["request"], plant["row"], "late"), fault
    assert fault["prompt_tokens"] == plant["row"] and "the first decode row" in fault["text"]
    assert fault["layers"] == [0, 2] and plant["wrong"] == 2  # qwen3_moe_dense's MoE layers; that token's rows only
    assert f"request {plant['request']} token {plant['row']}" in plant["summary"]


def assert_fault_named(oracle: dict[str, Any], name: str) -> None:
    found = oracle["mutations"][name]
    print(f"{name}: {found['planted_rows']} rows planted, {found['wrong']} wrong, verdict {found['verdict']}")
    assert found["planted_rows"] > 0 and found["wrong"] == found["planted_rows"]
    assert found["verdict"] == found["expected"] and f"FAIL {found['expected']}" in found["summary"], found
