# SPDX-License-Identifier: Apache-2.0
"""The verdict on the rows across vLLM's weight reload (``preflight.weight_reload``), on results shaped as ``check``'s:
the e2e suite's, the GPU run's and doctor's self-check part."""

from __future__ import annotations

from typing import Any

from vllm_ascend_routing.preflight import weight_reload


def result(same_tokens: bool = True) -> dict[str, Any]:
    def exact(rows: int) -> dict[str, Any]:
        return {"rows": rows, "matched": rows, "near_ties": 0, "ok": True, "problems": []}

    return {
        "vllm": "0.30.0",
        "same_tokens": [True, same_tokens],
        "before": exact(200),
        "after": exact(200),
        "first_moe_layer": 0,
        "after_first_moe_layer": exact(70),
        "checked_after": {"rows_checked": 200, "zero_rows": 0, "invalid_ids": 0, "steps_checked": 12},
    }


def test_a_reload_that_kept_every_layer_recorded_passes() -> None:
    assert weight_reload.failures(result()) == []
    part = weight_reload.self_check_part(result())
    assert part["ok"] and part["rows"] == part["matched"] == 200 and part["note"] == ""


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


def test_the_first_moe_layer_must_be_exact_even_when_the_model_changed() -> None:
    changed = result(same_tokens=False)
    changed["after_first_moe_layer"].update(matched=69, ok=False)
    assert any("after_first_moe_layer: 69 of 70" in line for line in weight_reload.failures(changed))


def test_a_check_that_counted_nothing_fails() -> None:
    silent = result()
    silent["checked_after"]["rows_checked"] = 0
    assert weight_reload.failures(silent) != []


def test_doctor_shows_the_first_layer_and_says_why_when_vllm_changed_the_model() -> None:
    part = weight_reload.self_check_part(result(same_tokens=False))
    assert part["ok"] and part["rows"] == part["matched"] == 70
    assert "vLLM 0.30.0's reload_weights changed what the model computes" in part["note"]
    zeros = result(same_tokens=False)
    zeros["checked_after"]["zero_rows"] = 3
    assert not weight_reload.self_check_part(zeros)["ok"]


def test_an_engine_whose_workers_cannot_reload_is_said_so_not_passed() -> None:
    # vllm-ascend's NPUWorker before 0.26 has no reload_weights: doctor says the part was not checked; the e2e suite
    # and the GPU run, whose workers have it, fail.
    not_run = {"not_run": "the engine's workers have no reload_weights (NPUWorker)"}
    assert weight_reload.self_check_part(not_run) is None
    assert weight_reload.failures(not_run) == ["reload_weights not run: " + not_run["not_run"]]


def test_the_workers_without_reload_weights_are_named() -> None:
    class NPUWorker:
        pass

    class Worker:
        def reload_weights(self) -> None: ...

    assert weight_reload._reload_weights_of(NPUWorker()) == "NPUWorker"
    assert weight_reload._reload_weights_of(Worker()) == ""


class _Reference:
    """A stand-in for the transformers reference (the code under test is ``offline.check``): 3 decoder layers,
    MoE layers 0 and 2, top-2 of 4 experts."""

    def routed_experts_and_logits(self, tokens: list[int]) -> tuple[Any, Any]:
        import numpy as np

        expected = np.zeros((len(tokens), 3, 2), dtype=np.int64)
        expected[:, 0], expected[:, 2] = [0, 1], [2, 3]
        logits = np.zeros((len(tokens), 3, 4), dtype=np.float32)
        logits[:, 0], logits[:, 2] = [9.0, 8.0, 0.0, 0.0], [0.0, 0.0, 9.0, 8.0]
        return expected, logits


def test_the_check_of_one_layer_compares_that_layer_alone() -> None:
    import numpy as np

    from vllm_ascend_routing.preflight import offline

    model: Any = type("Model", (), {"moe_layers": (0, 2)})()
    rows = np.zeros((4, 3, 2), dtype=np.int16)
    rows[:, 0] = [1, 0]  # layer 0 right (any order); layer 2 all zero, as a dropped capture leaves it
    done = offline.Completion([5, 6, 7], [8, 9], rows)
    assert not offline.check(_Reference(), model, [done]).ok  # every MoE layer: layer 2 is wrong
    first = offline.check(_Reference(), model, [done], layers=(0,))
    assert first.ok and first.rows == first.matched == 4
    last = offline.check(_Reference(), model, [done], layers=(2,))
    assert not last.ok and last.matched == 0
