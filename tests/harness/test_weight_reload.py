# SPDX-License-Identifier: Apache-2.0
"""The verdict on vLLM's weight reload (``weight_reload.failures``), on results shaped as ``reload_part``'s."""

from __future__ import annotations

from typing import Any

from tests.harness import weight_reload


def result(same_tokens: bool = True) -> dict[str, Any]:
    def exact(rows: int) -> dict[str, Any]:
        return {"rows": rows, "matched": rows, "ok": True, "problems": []}

    return {
        "vllm": "0.30.0",
        "same_tokens": [True, same_tokens],
        "before": exact(200),
        "after": exact(200),
        "after_first_moe_layer": exact(70),
        "checked_after": {"rows_checked": 200, "zero_rows": 0, "invalid_ids": 0, "steps_checked": 12},
    }


def test_a_reload_that_kept_every_layer_recorded_passes() -> None:
    assert weight_reload.failures(result()) == []


def test_zero_rows_after_the_reload_fail_even_when_the_model_changed() -> None:
    # vLLM's reload changed the model (other tokens): later layers are not compared, but a dropped capture's zeros are
    changed = result(same_tokens=False)
    changed["after"].update(matched=90, ok=False)
    assert weight_reload.failures(changed) == []
    changed["checked_after"]["zero_rows"] = 4
    assert any("counted" in line for line in weight_reload.failures(changed))


def test_rows_after_a_reload_that_kept_the_model_must_all_be_exact() -> None:
    kept = result()
    kept["after"].update(matched=199, ok=False)
    assert any("after: 199 of 200" in line for line in weight_reload.failures(kept))


def test_a_check_that_counted_nothing_fails() -> None:
    silent = result()
    silent["checked_after"]["rows_checked"] = 0
    assert weight_reload.failures(silent) != []


def test_other_tokens_after_the_reload_fail_where_vllms_reload_keeps_the_model() -> None:
    changed = result(same_tokens=False)
    changed["vllm"] = "0.23.0"
    assert any("changed the generated tokens" in line for line in weight_reload.failures(changed))
