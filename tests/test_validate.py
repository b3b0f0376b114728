# SPDX-License-Identifier: Apache-2.0
"""Validation mode: each contract rule catches its violation; a correct array passes."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
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


def test_the_same_expert_twice_is_found_anywhere_in_a_wide_row() -> None:
    """Top-4 rows: a repeat in columns that are not neighbours is found as well as one in neighbouring columns."""
    model = ModelRouting(num_experts=8, num_layers=1, moe_layers=frozenset({0}))
    rows = np.array([[[3, 1, 7, 5]], [[3, 1, 3, 5]], [[6, 2, 4, 2]], [[0, 0, 1, 2]]], dtype=np.uint8)
    found = check(rows, request_id="r", expected_rows=4, model=model)
    assert [(v.what, v.row) for v in found] == [("the same expert twice in one row", row) for row in (1, 2, 3)]


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


class _StandInEngine:
    """vLLM's LLMEngine / AsyncLLM as far as validation mode sees them: an ``__init__(self, vllm_config)``."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config


class _StandInState:
    """vLLM's RequestState: its real ``_new_completion_output`` needs a whole engine, so it is stood in for by one
    that returns the array under test."""

    routed: np.ndarray | None = None

    def __init__(self, prompt_len: int, outputs: int, prompt_start: int) -> None:
        self.request_id, self.prompt_len = "req-1", prompt_len
        self.detokenizer = SimpleNamespace(output_token_ids=[7] * outputs)
        setattr(self, validate._PROMPT_START, prompt_start)

    @classmethod
    def from_new_request(cls, tokenizer: Any, request: Any) -> Any:
        return cls(4, 3, 0)

    def _new_completion_output(self, token_ids: Any, finish_reason: Any, stop_reason: Any) -> Any:
        return SimpleNamespace(routed_experts=self.routed)


def _qwen_config() -> Any:
    """A vllm_config for MODEL: 8 experts, 3 layers, layer 1 dense (Qwen-MoE's mlp_only_layers)."""
    hf = SimpleNamespace(num_hidden_layers=3, decoder_sparse_step=1, mlp_only_layers=[1])
    return SimpleNamespace(model_config=SimpleNamespace(hf_text_config=hf, get_num_experts=lambda: 8))


@pytest.fixture
def front_end(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """vLLM's three front-end modules, their classes stood in for (no vLLM here), then ``validate.install()``
    in strict mode: what the plugin does at start-up."""
    classes: dict[str, Any] = {
        "llm_engine": type("LLMEngine", (_StandInEngine,), {}),
        "async_llm": type("AsyncLLM", (_StandInEngine,), {}),
        "output_processor": type("RequestState", (_StandInState,), {}),
    }
    for module_name, cls in classes.items():
        module = ModuleType(f"vllm.v1.engine.{module_name}")
        setattr(module, cls.__name__, cls)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "strict")
    monkeypatch.setattr(validate, "_model", None)
    monkeypatch.setattr(validate, "_checked", 0)
    validate.install()
    return classes


@pytest.mark.parametrize("engine", ["llm_engine", "async_llm"])
def test_installed_hooks_learn_the_model_from_the_engine_and_count_each_array(
    front_end: dict[str, Any], engine: str
) -> None:
    """install() -> the engine's creation records the model -> each finished request is checked and counted."""
    state_cls = front_end["output_processor"]
    front_end[engine](_qwen_config())  # the patched __init__ records the model
    state = state_cls.from_new_request(
        None, SimpleNamespace(sampling_params=SimpleNamespace(routed_experts_prompt_start=1))
    )
    state.routed = good()
    state._new_completion_output([], "stop", None)  # 4 + 3 - 1 - 1 = 5 rows: passes
    assert validate.checked_arrays() == 1
    state.routed = good(6)
    with pytest.raises(RoutingValidationError, match="6 rows, expected 5"):
        state._new_completion_output([], "stop", None)
    assert validate.checked_arrays() == 2
    state.routed = None  # a request without routed experts: nothing to check, not counted
    state._new_completion_output([], "stop", None)
    assert validate.checked_arrays() == 2


def test_without_the_engines_model_validation_refuses_instead_of_passing(front_end: dict[str, Any]) -> None:
    state = front_end["output_processor"](4, 3, 1)
    state.routed = good()
    with pytest.raises(validate.ValidationUnavailableError, match="never saw this engine's model.*VALIDATE=0"):
        state._new_completion_output([], "stop", None)
    assert validate.checked_arrays() == 0


@pytest.mark.vllm
def test_front_end_hooks_are_installed_on_vllms_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the real vLLM: every validation patch target is wrapped by install() (the stand-ins above take their
    place for the behaviour)."""
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "strict")
    for patch in validate.PATCHES:
        owner_name, _, attribute = patch.target.rpartition(".")
        owner = patching.resolve(owner_name)
        monkeypatch.setattr(owner, attribute, owner.__dict__[attribute])  # restored after the test
    validate.install()
    for patch in validate.PATCHES:
        owner_name, _, attribute = patch.target.rpartition(".")
        assert patching.is_wrapped(patching.resolve(owner_name).__dict__[attribute]), patch.target


def _moe_axis(rows: int) -> np.ndarray:
    """vLLM 0.21.0's form of ``good(rows)``: the MoE layers' rows only (layers 0 and 2)."""
    return good(rows)[:, [0, 2]]


def _unknown_family(monkeypatch: pytest.MonkeyPatch, mode: str) -> Any:
    """Validation in ``mode`` for a model whose config names no MoE layers, and a request that finished with
    4 prompt + 2 generated tokens (5 rows)."""
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", mode)
    monkeypatch.setattr(validate, "_model", ModelRouting(8, 3, None))
    monkeypatch.setattr(validate, "_checked", 0)
    monkeypatch.setattr(validate, "_unchecked", 0)
    return SimpleNamespace(prompt_len=4, request_id="req-9", detokenizer=SimpleNamespace(output_token_ids=[5, 5]))


def test_strict_refuses_rows_it_cannot_place_on_the_decoder_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.21.0 returns rows on the MoE-layer axis; with the model's MoE layers unknown they cannot be
    checked: strict mode refuses, naming the request and what to do, instead of passing them unchecked."""
    state = _unknown_family(monkeypatch, "strict")
    with pytest.raises(validate.ValidationUnavailableError, match="request req-9.*VLLM_ASCEND_ROUTING_VALIDATE=1"):
        validate.keep_whole_request(state, _moe_axis(5))
    assert validate.checked_arrays() == 0 and validate.unchecked_arrays() == 0


def test_validation_mode_1_logs_and_counts_rows_it_cannot_place(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not strict: the request is served, its array logged as an error and counted unchecked (never checked)."""
    state = _unknown_family(monkeypatch, "1")
    generated_only = SimpleNamespace(routed_experts=_moe_axis(2))
    finish = validate._validating(lambda self, *args: generated_only, strict=False)
    with caplog.at_level("ERROR"):
        validate.keep_whole_request(state, _moe_axis(5))
        assert finish(state) is generated_only
        validate.keep_whole_request(state, _moe_axis(5))
    assert validate.unchecked_arrays() == 2 and validate.checked_arrays() == 0
    errors = [record for record in caplog.records if record.levelname == "ERROR"]
    assert len(errors) == 1 and "request req-9" in errors[0].getMessage() and "Not checked" in errors[0].getMessage()


def test_known_moe_layers_place_the_rows_and_check_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same request with the MoE layers known: placed on the decoder layers, checked, counted."""
    state = _unknown_family(monkeypatch, "strict")
    monkeypatch.setattr(validate, "_model", MODEL)
    finish = validate._validating(lambda self, *args: SimpleNamespace(routed_experts=None), strict=True)
    validate.keep_whole_request(state, _moe_axis(5))
    finish(state)
    assert validate.checked_arrays() == 1 and validate.unchecked_arrays() == 0
    validate.keep_whole_request(state, _moe_axis(6))  # one row too many: the check runs and says so
    with pytest.raises(RoutingValidationError, match="6 rows, expected 5"):
        finish(state)
