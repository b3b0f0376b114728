# SPDX-License-Identifier: Apache-2.0
"""The row store end to end (docs/output.md, "The row store"): a server with ``VLLM_ASCEND_ROUTING_STORE`` returns
keys only, and every row fetched by key in another process equals the transformers reference
(``tests/harness/row_store.py``). ``shm`` once per generation: served on 0.30.0 (runner-output) and 0.32.0 (aux-output),
refused at start-up by name on 0.20.2 (shm: a server's log ends with the refusal); Mooncake (a real master on
localhost, the master killed mid-run) once, on 0.30.0."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests.harness import distributed
from tests.harness.generation_cases import once, once_per_generation

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

SERVES = ("runner-output", "aux-output")


def exact(part: dict[str, Any]) -> None:
    assert part["ok"] and part["rows"] == part["matched"] > 0, part


@pytest.fixture(scope="module", params=["shm", "mooncake"])
def served(request: pytest.FixtureRequest, scenario: Any, generation: str) -> dict[str, Any]:
    release = distributed.vllm_release()
    if generation not in SERVES and request.param == "mooncake":
        pytest.skip(f"{generation}: a store is refused at start-up whichever it is (the shm case shows it)")
    env = None
    if request.param == "mooncake":
        once("the Mooncake row store", release)
        from tests.scripts import load

        env = load("scripts/mooncake_kit.py", "mooncake_kit").kit(sys.executable).env()
    else:
        once_per_generation("the row store", release)
    result = scenario("store", "--store", request.param, env=env)
    print(f"row store {request.param} ({generation}): {result}")
    return dict(result)


def refused_here(served: dict[str, Any]) -> bool:
    """0.20.x / 0.21.0: the server refused the store at start-up, naming it (the other tests have nothing to read)."""
    if "refused" not in served:
        return False
    assert "the row store needs vLLM 0.22 or later" in served["refused"], served
    assert "VLLM_ASCEND_ROUTING_STORE='shm'" in served["refused"], served
    return True


def test_keys_only_and_every_fetched_row_exact(served: dict[str, Any]) -> None:
    if refused_here(served):
        return
    part = served["completions"]
    exact(part)
    assert part["samples"] == part["keys"] == 6 and part["inline_rows"] == 0 and part["records_agree"], part
    assert part["distinct_samples"] == 6, part  # each sample its own rows
    assert part["max_response_bytes_per_choice"] <= 1024 + 512, part  # the record and tokens, not the rows


def test_streamed_chat_and_generate_carry_the_key(served: dict[str, Any]) -> None:
    if refused_here(served):
        pytest.skip("refused at start-up (test_keys_only_and_every_fetched_row_exact checks the refusal)")
    streamed = served["streamed"]
    assert streamed["key_in_finishing_chunk"] and streamed["rows_in_any_chunk"] == 0, streamed
    exact(streamed)
    assert served["chat"]["key"] and not served["chat"]["rows_inline"] and served["chat"]["rows"] > 0
    generated = served["generate"]
    assert generated["key"] and not generated["rows_inline"], generated
    exact(generated)


def test_inline_on_request_and_slices_from_keys(served: dict[str, Any]) -> None:
    if refused_here(served):
        pytest.skip("refused at start-up (test_keys_only_and_every_fetched_row_exact checks the refusal)")
    assert served["inline"]["key"] is None, served["inline"]
    exact(served["inline"])
    lazy = served["lazy"]
    assert lazy["equal"] and lazy["slice_bytes"] <= lazy["bytes_read"] <= 1.1 * lazy["slice_bytes"], lazy
    assert lazy["bytes_read"] < lazy["whole_bytes"] / 2, lazy


def test_released_made_up_and_old_keys_never_resolve(served: dict[str, Any]) -> None:
    if refused_here(served):
        pytest.skip("refused at start-up (test_keys_only_and_every_fetched_row_exact checks the refusal)")
    assert served["release"] == {"freed": 1, "refused_by_name": True}
    assert served["made_up"]["refused_by_name"]
    restart = served["after_restart"]
    assert restart["keys"] >= 7, restart
    if served["store"] == "shm":  # refused by name: the exited engine's lease is gone
        assert restart["refused_by_name"] == restart["keys"], restart
    else:  # the master was killed: nothing resolves (a store error), never another start's rows
        assert restart["refused_by_name"] + restart["store_gone"] == restart["keys"], restart


def test_the_master_killed_mid_run_returns_rows_inline_with_the_reason(served: dict[str, Any]) -> None:
    if refused_here(served):
        pytest.skip("refused at start-up (test_keys_only_and_every_fetched_row_exact checks the refusal)")
    if served["store"] != "mooncake":
        pytest.skip("a Mooncake fault (the shm store's faults: tests/store/test_publishing.py)")
    killed = served["master_killed"]
    exact(killed)
    assert killed["key"] is None and "StoreUnavailableError" in str(killed["fallback"]), killed
