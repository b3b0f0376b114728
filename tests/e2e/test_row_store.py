# SPDX-License-Identifier: Apache-2.0
"""The row store end to end (docs/output.md, "The row store"): a server with ``VLLM_ASCEND_ROUTING_STORE=shm`` returns
keys only, and every row fetched by key in another process equals the transformers reference
(``tests/harness/row_store.py``). Once per generation: on 0.30.0 (runner-output) and 0.32.0 (aux-output) served, on
0.20.2 refused at start-up."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import distributed
from tests.harness.generation_cases import once_per_generation

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

SERVES = ("runner-output", "aux-output")


def exact(part: dict[str, Any]) -> None:
    assert part["ok"] and part["rows"] == part["matched"] > 0, part


@pytest.fixture(scope="module")
def served(scenario: Any, generation: str) -> dict[str, Any]:
    once_per_generation("the row store", distributed.vllm_release())
    result = scenario("store", "--store", "shm")
    print(f"row store ({generation}): {result}")
    return dict(result)


def test_keys_only_and_every_fetched_row_exact(served: dict[str, Any], generation: str) -> None:
    if generation not in SERVES:
        assert "needs vLLM 0.22 or later" in served["refused"], served
        return
    part = served["completions"]
    exact(part)
    assert part["samples"] == part["keys"] == 6 and part["inline_rows"] == 0 and part["records_agree"], part
    assert part["distinct_samples"] == 6, part  # each sample its own rows
    assert part["max_response_bytes_per_choice"] <= 1024 + 512, part  # the record, not the rows


def test_streamed_chat_and_generate_carry_the_key(served: dict[str, Any], generation: str) -> None:
    if generation not in SERVES:
        pytest.skip("refused at start-up (the test above)")
    streamed = served["streamed"]
    assert streamed["key_in_finishing_chunk"] and streamed["rows_in_any_chunk"] == 0, streamed
    exact(streamed)
    assert served["chat"]["key"] and not served["chat"]["rows_inline"] and served["chat"]["rows"] > 0
    generated = served["generate"]
    assert generated["key"] and not generated["rows_inline"], generated
    exact(generated)


def test_inline_on_request_and_slices_from_keys(served: dict[str, Any], generation: str) -> None:
    if generation not in SERVES:
        pytest.skip("refused at start-up (the test above)")
    assert served["inline"]["key"] is None, served["inline"]
    exact(served["inline"])
    lazy = served["lazy"]
    assert lazy["equal"] and lazy["slice_bytes"] <= lazy["bytes_read"] <= 1.1 * lazy["slice_bytes"], lazy
    assert lazy["bytes_read"] < lazy["whole_bytes"] / 2, lazy


def test_released_made_up_and_old_keys_are_refused_by_name(served: dict[str, Any], generation: str) -> None:
    if generation not in SERVES:
        pytest.skip("refused at start-up (the test above)")
    assert served["release"] == {"freed": 1, "refused_by_name": True}
    assert served["made_up"]["refused_by_name"]
    restart = served["after_restart"]
    assert restart["keys"] >= 6 and restart["refused_by_name"] == restart["keys"], restart
