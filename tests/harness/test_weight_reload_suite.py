# SPDX-License-Identifier: Apache-2.0
"""The e2e suite's reload verdict (``weight_reload_suite.failures``): doctor's, plus what it knows per release."""

from __future__ import annotations

from tests.harness import weight_reload_suite
from tests.preflight.test_weight_reload import result


def test_other_tokens_after_the_reload_fail_where_vllms_reload_keeps_the_model() -> None:
    changed = result(same_tokens=False)
    assert weight_reload_suite.failures(changed) == []  # 0.30.0: its own reload changes the model
    changed["vllm"] = "0.23.0"
    assert any("changed the generated tokens" in line for line in weight_reload_suite.failures(changed))


def test_a_reload_that_did_not_run_fails_the_suite() -> None:
    assert weight_reload_suite.failures({"not_run": "no reload_weights (Worker)"}) == [
        "reload_weights not run: no reload_weights (Worker)"
    ]
