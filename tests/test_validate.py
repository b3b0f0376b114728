# SPDX-License-Identifier: Apache-2.0
"""Validation mode: each contract rule catches its violation; a correct array passes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_ascend_routing import patching, validate
from vllm_ascend_routing.validate import ModelRouting, RoutingValidationError, check, moe_layer_ids

MODEL = ModelRouting(num_experts=8, num_layers=3, moe_layers=frozenset({0, 2}))  # layer 1 dense


def good(rows: int = 5) -> np.ndarray:
    rng = np.random.default_rng(0)
    array = np.zeros((rows, 3, 2), dtype=np.uint8)
    for layer in (0, 2):
        for row in range(rows):
            array[row, layer] = rng.choice(8, size=2, replace=False)
    array[0, 0] = [1, 2]  # no MoE layer can be all zero by chance
    array[0, 2] = [3, 4]
    return array


def whats(array: np.ndarray, rows: int = 5) -> list[tuple[str, int | None, int | None]]:
    return [(v.what, v.layer, v.row) for v in check(array, request_id="r", expected_rows=rows, model=MODEL)]


def test_a_correct_array_passes() -> None:
    assert whats(good()) == []


def test_each_rule() -> None:
    out_of_range = good()
    out_of_range[3, 2, 1] = 8
    assert whats(out_of_range) == [("id outside [0, 8)", 2, 3)]
    duplicate = good()
    duplicate[1, 0] = [5, 5]
    assert whats(duplicate) == [("the same expert twice in one row", 0, 1)]
    zeros = good()
    zeros[:, 2] = 0  # what a bypassed router gives: the layer's rows are all zero
    assert ("MoE layer all zero across the request", 2, None) in whats(zeros)
    dense = good()
    dense[4, 1] = [0, 3]
    assert whats(dense) == [("non-zero ids in a dense layer", 1, 4)]
    assert whats(good(4), rows=5) == [("4 rows, expected 5", None, None)]
    assert "shape" in whats(np.zeros((5, 2, 2), dtype=np.uint8))[0][0]


def test_int32_padding_minus_one_is_out_of_range() -> None:
    array = good().astype(np.int32)
    array[2, 0, 0] = -1
    assert whats(array) == [("id outside [0, 8)", 0, 2)]


def test_moe_layers_from_config_families() -> None:
    qwen = SimpleNamespace(decoder_sparse_step=1, mlp_only_layers=[1])
    assert moe_layer_ids(qwen, 3) == frozenset({0, 2})
    deepseek = SimpleNamespace(first_k_dense_replace=1, moe_layer_freq=1)
    assert moe_layer_ids(deepseek, 4) == frozenset({1, 2, 3})
    assert moe_layer_ids(SimpleNamespace(num_local_experts=8), 2) == frozenset({0, 1})
    assert moe_layer_ids(SimpleNamespace(), 2) is None


def test_unknown_family_still_checks_rows() -> None:
    model = ModelRouting(8, 3, None)
    array = good()
    assert check(array, request_id="r", expected_rows=5, model=model) == []  # zero dense rows are fine
    array[0, 1] = [2, 2]
    found = check(array, request_id="r", expected_rows=5, model=model)
    assert [(v.what, v.layer, v.row) for v in found] == [("the same expert twice in one row", 1, 0)]


def test_strict_raises_with_request_layer_and_row() -> None:
    array = good()
    array[3, 2, 1] = 9
    violations = check(array, request_id="req-7", expected_rows=5, model=MODEL)
    validate.report(violations, strict=False)  # logs only
    with pytest.raises(RoutingValidationError, match="request req-7 layer 2 row 3"):
        validate.report(violations, strict=True)


@pytest.mark.vllm
def test_front_end_hooks_check_finished_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.engine import output_processor

    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "strict")
    state_cls = output_processor.RequestState
    vllm_method = state_cls.__dict__["_new_completion_output"]
    for name in ("_new_completion_output", "from_new_request"):
        monkeypatch.setattr(state_cls, name, state_cls.__dict__[name])  # restored after the test
    validate.install()
    monkeypatch.setattr(validate, "_model", MODEL)
    array = good()

    def request_state(routed: np.ndarray, prompt_start: int) -> Any:
        state = state_cls.__new__(state_cls)
        state.request_id, state.prompt_len = "req-1", 4
        state.detokenizer = SimpleNamespace(output_token_ids=[7, 7, 7])
        setattr(state, validate._PROMPT_START, prompt_start)
        return state

    original = validate._validating(lambda self, *a, **k: SimpleNamespace(routed_experts=array), strict=True)
    original(request_state(array, prompt_start=1), [], "stop", None)  # 4 + 3 - 1 - 1 = 5 rows: passes
    with pytest.raises(RoutingValidationError, match="5 rows, expected 6"):
        original(request_state(array, prompt_start=0), [], "stop", None)
    installed = state_cls.__dict__["_new_completion_output"]
    assert patching.is_wrapped(installed)
    assert patching.is_wrapped(vllm_method) or patching.original_of(installed) is vllm_method
