# SPDX-License-Identifier: Apache-2.0
"""The re-prefill consistency oracle (doctor --model's) on a real engine of this release, float32: every
generation row equals its token's re-prefill row (100%, PASS), and each fault planted in the generation's output
(tests/harness/routing_mutations.py) FAILS naming it. No engine of its own: the oracle runs on the offline
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


def assert_clean(oracle: dict[str, Any]) -> None:
    """Every generation row agrees with its re-prefill (qwen3_moe_dense: MoE layers 0 and 2, dense layer 1)."""
    clean, work = oracle["consistency"], oracle["workload"]
    print(f"{clean['summary']} ({oracle['oracle_seconds']:.1f} s)")
    for layer in clean["layers"]:
        print(f"layer {layer['layer']}: {layer['exact']}/{layer['rows']} rows, offsets {layer['offsets']}")
    assert clean["ok"] and clean["verdict"] == "PASS", clean["summary"]
    assert clean["exact"] == clean["rows"] > 0 and clean["near_ties"] == 0 and not clean["shape_problems"]
    assert [layer["layer"] for layer in clean["layers"]] == [0, 2] and clean["dense_layers"] == [1]
    # What the workload exercised: prefix-cache hits in the generation, none in the re-prefill, chunked prefills.
    assert work["cached_tokens"] > 0 and work["reprefill_cached_tokens"] == 0 and not work["problems"]
    assert work["longest_prompt"] > 128  # > the scenario's max_num_batched_tokens: prefilled in chunks


def assert_fault_named(oracle: dict[str, Any], name: str) -> None:
    found = oracle["mutations"][name]
    print(f"{name}: {found['planted_rows']} rows planted, {found['wrong']} wrong, verdict {found['verdict']}")
    assert found["planted_rows"] > 0 and found["wrong"] == found["planted_rows"]
    assert found["verdict"] == found["expected"] and f"FAIL {found['expected']}" in found["summary"], found
