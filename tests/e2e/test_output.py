# SPDX-License-Identifier: Apache-2.0
"""The output features end to end (docs/output.md): per-request opt-out and omission, the provenance record, the
weight version across an update, streamed rows, each returned row against the transformers reference.

No engine of their own: they read the offline ``qwen3_moe`` eager run and the serve run of
``test_routed_experts.py`` (the same scenario results), which run ``tests/harness/output_features.py`` last.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.harness import distributed
from tests.harness.generation_cases import once_per_generation

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

SERVES = ("runner-output", "aux-output")  # the generations with per-request options (vLLM 0.22+)


def offline(scenario: Any) -> dict[str, Any]:
    result = scenario("offline", "--arch", "qwen3_moe", "--mode", "eager", "--prompts", "10")
    return dict(result["output"])


def exact(part: dict[str, Any]) -> None:
    """Every row of the array is the reference's, the array has the rows its record says, and they add up."""
    info = part["info"]
    assert part["ok"] and part["rows"] == part["matched"] > 0, part
    assert part["shape"][0] == part["expected_rows"] == info["rows"], part
    assert info["computed"] + info["cached"] + info["loaded"] == info["rows"], info
    assert info["dtype"] == "uint8" and info["num_layers"] == part["shape"][1] and info["top_k"] == part["shape"][2]


def test_options_refused_per_request_where_the_engine_cannot_honour_them(scenario: Any, generation: str) -> None:
    result = offline(scenario)
    print(f"{generation}: the output checks added {result['seconds']} s to the offline engine's scenario")
    refused = result["refused"]
    if generation not in SERVES:
        assert "need vLLM 0.22 or later" in refused["any_option"], refused
        return
    assert "return_routed_experts='maybe': expected true or false" in refused["malformed"], refused
    assert "routed_experts_omit=4: past the last of the prompt's 3 tokens" in refused["omit_past_prompt"], refused


def needs_options(generation: str) -> None:
    if generation not in SERVES:
        pytest.skip(f"vLLM 0.20.x / 0.21.0 ({generation}): per-request options are refused (the test above)")


def test_opted_out_requests_in_a_mixed_batch(scenario: Any, generation: str) -> None:
    needs_options(generation)
    mixed = offline(scenario)["mixed"]
    assert [part["asked"] for part in mixed].count({"return_routed_experts": False}) == 2
    for part in mixed:
        if part["asked"] == {"return_routed_experts": False}:
            assert part["rows"] is None and part["info"] is None, part
        else:
            exact(part)
            assert part["info"]["first_token"] == 0 and part["info"]["generation"] == generation
    rows = sum(part["matched"] for part in mixed if part["rows"])
    print(f"{generation}: mixed batch of 8, 2 opted out (no rows), 6 exact: {rows}/{rows} rows")


def test_an_opted_out_requests_blocks_serve_exact_rows_to_a_later_request(scenario: Any, generation: str) -> None:
    needs_options(generation)
    part = offline(scenario)["prefix_of_opted_out"]
    assert part["opted_out_rows"] is None and part["cached_tokens"] > 0, part
    exact(part)
    assert part["info"]["cached"] == part["cached_tokens"]  # rows computed by the opted-out request, served from cache
    assert part["info"]["computed"] == part["shape"][0] - part["cached_tokens"]


@pytest.mark.parametrize("name", ["omit_cached", "omit_token"])
def test_rows_sent_once_with_the_start_reported(scenario: Any, generation: str, name: str) -> None:
    needs_options(generation)
    part = offline(scenario)[name]
    exact(part)
    first = part["info"]["first_token"]
    expected = part["cached_tokens"] if name == "omit_cached" else part["asked"]
    assert first == expected > 0 and part["info"]["cached"] == 0, part
    conversation = part["conversation"]
    assert "error" not in conversation, conversation
    assert conversation["ok"] and conversation["rows"] == conversation["matched"] > 0, conversation
    print(f"{generation} {name}: {part['shape'][0]} rows sent from token {first}, conversation exact")


def test_each_sample_of_an_n_2_request_has_its_record(scenario: Any, generation: str) -> None:
    needs_options(generation)
    samples = offline(scenario)["samples"]
    assert len(samples) == 2
    for part in samples:
        exact(part)
    print(f"{generation}: n=2 samples {sum(p['matched'] for p in samples)}/{sum(p['rows'] for p in samples)} exact")


def test_a_request_straddling_a_weight_update_says_so(scenario: Any, generation: str) -> None:
    needs_options(generation)
    straddle = offline(scenario)["straddle"]
    assert straddle["versions_after_reload"] == [2], straddle
    request = straddle["request"]
    exact(request)
    assert request["info"]["weight_version"] == {"first": 1, "last": 2, "cached_from": None}
    assert request["info"]["straddles"] is True
    again = straddle["cached_before_update"]  # its prompt again: blocks cached before the update
    exact(again)
    assert again["cached_tokens"] > 0 and again["info"]["weight_version"] == {"first": 2, "last": 2, "cached_from": 1}
    assert again["info"]["straddles"] is True
    after_reset = straddle["cached_after_reset"]
    exact(after_reset)
    assert after_reset["cached_tokens"] > 0
    assert after_reset["info"]["weight_version"] == {"first": 2, "last": 2, "cached_from": 2}
    assert after_reset["info"]["straddles"] is False
    print(f"{generation}: straddling request's record: {json.dumps(request['info'])}")


def serve(scenario: Any, generation: str) -> dict[str, Any]:
    if generation not in SERVES:
        pytest.skip("vLLM 0.20.x has no routed_experts field in its OpenAI API (nothing to stream)")
    once_per_generation("the serve scenario", distributed.vllm_release())
    return dict(scenario("serve", "--arch", "mixtral", "--prompts", "4", in_process=False)["output"])


def test_http_records_and_opt_out(scenario: Any, generation: str) -> None:
    result = serve(scenario, generation)
    print(f"{generation}: the output checks added {result['seconds']} s to the serve scenario")
    completion = result["completion"]
    assert completion["ok"] and completion["rows"] == completion["matched"] > 0, completion
    assert completion["info"]["rows"] == completion["shape"][0] and completion["info"]["first_token"] == 0
    assert result["chat"]["same_as_completion"] and result["chat"]["info"] == completion["info"], result["chat"]
    opted = result["opted_out"]
    assert opted == {"routed_experts": None, "info": "absent", "streamed_rows": 0}, opted
    omitted = result["omit_cached"]
    assert omitted["ok"] and omitted["rows"] == omitted["matched"] > 0, omitted
    assert omitted["info"]["first_token"] > 0 and omitted["info"]["cached"] == 0, omitted
    print(
        f"{generation} HTTP: completion {completion['matched']}/{completion['rows']} rows exact, "
        f"omit cached {omitted['matched']}/{omitted['rows']} from token {omitted['info']['first_token']}"
    )


@pytest.mark.parametrize("endpoint", ["completion_stream", "chat_stream", "generate_stream"])
def test_streamed_choices_carry_the_rows_in_their_final_chunk(scenario: Any, generation: str, endpoint: str) -> None:
    result = serve(scenario, generation)
    if endpoint == "generate_stream":
        assert "error" not in result["generate"], result["generate"]  # every release here serves it
    part = result[endpoint]
    assert part["chunks_with_rows"] == 1 and part["rows_in_finishing_chunk"], part
    same = part.get("same_as_non_streamed", part.get("same_as_completion"))
    assert same, part
    assert part["info"] == result["completion"]["info"], part
    if endpoint == "completion_stream":
        assert part["ok"] and part["rows"] == part["matched"] > 0 and part["chunks"] > 2, part
        print(f"{generation} streamed completion: {part['matched']}/{part['rows']} rows exact in its final chunk")
    if endpoint == "generate_stream":
        assert result["generate"]["same_as_completion"] and result["generate"]["info"] == part["info"]
