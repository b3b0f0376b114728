# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.21.0's generation (``compat/device_cache.py``) without vLLM: the worker's slot-indexed store and what it
ships per step (chunked prefill, prefix-cache hits, rejected drafts), the front-end's join, and the replay
bridge's reading of 0.21.0's two arrays (``contract.from_device_cache``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vllm_ascend_routing import contract, replay
from vllm_ascend_routing.capture import PreparedCapture
from vllm_ascend_routing.compat.device_cache import adapter as device_cache

BLOCK, LAYERS, TOP_K = 4, 3, 2
MOE = (0, 2)  # decoder layer 1 is dense


def prepared(num_tokens: int = 16) -> PreparedCapture:
    buffer = torch.zeros((num_tokens, LAYERS, TOP_K), dtype=torch.int16)
    return PreparedCapture.bound(buffer, torch.zeros(1, dtype=torch.int64), 8, MOE)


def token_rows(positions: range) -> np.ndarray:
    """A distinct row per position (MoE layers only): ids derived from the position."""
    return np.array([[[p % 8, (p + 1) % 8], [(p + 2) % 8, (p + 3) % 8]] for p in positions], dtype=np.int16)


def same_rows(shipped: dict[str, np.ndarray] | None, request: str, expected: np.ndarray) -> bool:
    """``shipped[request]`` holds ``expected``'s rows in vLLM 0.21.0's dtype, int16 (``np.array_equal`` alone
    ignores the dtype, which is part of the contract)."""
    assert shipped is not None
    assert shipped[request].dtype == np.int16, shipped[request].dtype
    return np.array_equal(shipped[request], expected)


class FakeRunner:
    """The fields of vLLM 0.21.0's V1 runner the adapter reads."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.input_batch = SimpleNamespace(req_ids=[], num_computed_tokens_cpu=np.zeros(8, dtype=np.int64))

    def _get_attention_kv_cache_gid(self) -> int:
        return 0


def ready(runner: FakeRunner, capture: PreparedCapture, num_blocks: int = 8) -> None:
    spec = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BLOCK))
    config = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[spec])
    device_cache.DeviceCacheAdapter().kv_cache_ready(runner, capture, config, False)


def step(
    runner: FakeRunner,
    capture: PreparedCapture,
    batch: list[tuple[str, int, int, list[int]]],  # (request, computed before, scheduled, block ids)
    sampled: dict[str, int],
    drafts: dict[str, list[int]] | None = None,
    finished: tuple[str, ...] = (),
) -> dict[str, np.ndarray] | None:
    """One step: the forward writes each scheduled position's row, then sampling ships."""
    api = device_cache.DeviceCacheAdapter()
    scheduler_output = SimpleNamespace(
        finished_req_ids=set(finished),
        num_scheduled_tokens={r: n for r, _, n, _ in batch},
        total_num_scheduled_tokens=sum(n for _, _, n, _ in batch),
        scheduled_spec_decode_tokens=drafts or {},
    )
    api.step_started(runner, capture, scheduler_output)
    runner.input_batch.req_ids = [r for r, _, _, _ in batch]
    start = 0
    for i, (request, computed, scheduled, blocks) in enumerate(batch):
        runner.input_batch.num_computed_tokens_cpu[i] = computed
        runner.requests[request] = SimpleNamespace(block_ids=(blocks,))
        capture.buffer[start : start + scheduled, list(MOE)] = torch.from_numpy(
            token_rows(range(computed, computed + scheduled))
        )
        start += scheduled
    output = SimpleNamespace(
        req_ids=list(runner.input_batch.req_ids),
        sampled_token_ids=[[7] * sampled.get(r, 0) for r, _, _, _ in batch],
        routed_experts_dict="unset",
    )
    api.sample(runner, capture, lambda: output)
    return output.routed_experts_dict  # type: ignore[return-value]


def test_chunked_prefill_is_shipped_once_the_request_samples() -> None:
    runner, capture = FakeRunner(), prepared()
    ready(runner, capture)
    assert step(runner, capture, [("a", 0, 6, [2, 5])], {}) is None  # a partial prefill chunk: no output
    shipped = step(runner, capture, [("a", 6, 3, [2, 5, 1])], {"a": 1})
    assert same_rows(shipped, "a", token_rows(range(9)))
    shipped = step(runner, capture, [("a", 9, 1, [2, 5, 1])], {"a": 1})
    assert same_rows(shipped, "a", token_rows(range(9, 10)))


def test_a_prefix_cache_hit_is_read_from_the_blocks_another_request_filled() -> None:
    runner, capture = FakeRunner(), prepared()
    ready(runner, capture)
    step(runner, capture, [("a", 0, 8, [3, 6])], {"a": 1})
    # b shares a's first block (positions 0-3) from the prefix cache: computed 4 before its first step
    shipped = step(runner, capture, [("b", 4, 5, [3, 0, 1])], {"b": 1}, finished=("a",))
    assert same_rows(shipped, "b", token_rows(range(9)))


def test_rejected_drafts_are_not_shipped() -> None:
    runner, capture = FakeRunner(), prepared()
    ready(runner, capture)
    step(runner, capture, [("a", 0, 4, [1, 2])], {"a": 1})
    # one input token and three drafts; one draft accepted: two tokens sampled, two positions valid
    shipped = step(runner, capture, [("a", 4, 4, [1, 2])], {"a": 2}, drafts={"a": [5, 6, 7]})
    assert same_rows(shipped, "a", token_rows(range(4, 6)))


def test_a_request_past_its_blocks_is_refused() -> None:
    runner, capture = FakeRunner(), prepared()
    ready(runner, capture)
    with pytest.raises(RuntimeError, match="cannot be placed"):
        step(runner, capture, [("a", 0, 6, [1])], {"a": 1})


def test_the_front_end_joins_the_chunks_on_the_final_output_and_trims_dropped_tokens() -> None:
    calls: list[Any] = []

    def make_request_output(self: Any, new_token_ids: Any, pooling_output: Any, finish_reason: Any, *args: Any,
                            routed_experts: Any = None) -> Any:  # fmt: skip
        calls.append(routed_experts)
        return routed_experts

    joined = device_cache._joining(make_request_output)
    state = SimpleNamespace(prompt_len=3, detokenizer=SimpleNamespace(output_token_ids=[9, 9]))
    first, second = token_rows(range(3)), token_rows(range(3, 6))
    assert joined(state, [9], None, None, None, None, first) is None  # positional, as process_outputs passes it
    whole = joined(state, [9], None, "length", None, None, routed_experts=second)
    # 3 prompt + 2 output tokens: 4 rows; the sixth row belongs to a token the scheduler dropped
    assert np.array_equal(whole, token_rows(range(4)))
    aborted = SimpleNamespace(prompt_len=3, detokenizer=SimpleNamespace(output_token_ids=[9]))
    joined(aborted, [9], None, None, None, None, first)
    assert np.array_equal(joined(aborted, [], None, "abort", None, None), token_rows(range(3)))


def test_from_device_cache_widens_to_the_decoder_layers() -> None:
    prompt, generated = token_rows(range(3)), token_rows(range(3, 5))
    widened = replay.from_device_cache(prompt, generated, MOE, LAYERS)
    assert widened.dtype == np.int32 and widened.shape == (5, LAYERS, TOP_K)
    assert np.array_equal(widened[:, list(MOE)], token_rows(range(5))) and not widened[:, 1].any()
    aligned = replay.align(widened, prompt_len=3, output_len=3)  # the 0.20.x layout: rows from token 0
    assert aligned.valid.tolist() == [True] * 5 + [False]
    assert np.array_equal(aligned.routes[:5, list(MOE)], token_rows(range(5)))
    with pytest.raises(ValueError, match="2 MoE layers"):
        contract.from_device_cache(np.zeros((2, LAYERS, TOP_K), np.int16), None, MOE, LAYERS)


def test_deepseek_first_k_dense_layers_are_not_columns() -> None:
    """DeepSeek / GLM: the first ``first_k_dense_replace`` layers are dense; the MoE axis has the rest only."""
    config = SimpleNamespace(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8)
    layers = contract.moe_layers(config)
    assert layers == (1, 2, 3)
    rows = np.ones((2, len(layers), TOP_K), dtype=np.int16)
    widened = contract.from_device_cache(rows, None, layers, 4)
    assert not widened[:, 0].any() and widened[:, 1:].all()


def test_validation_checks_the_whole_request_on_the_decoder_layer_axis(monkeypatch: pytest.MonkeyPatch) -> None:
    """The final output carries the generated rows only; validation checks the joined request instead."""
    from vllm_ascend_routing import validate

    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "strict")
    monkeypatch.setattr(validate, "_model", validate.ModelRouting(8, LAYERS, frozenset(MOE)))
    generated_only = SimpleNamespace(routed_experts=token_rows(range(3, 4)))
    check = validate._validating(lambda self, *args: generated_only, strict=True)
    state = SimpleNamespace(prompt_len=3, request_id="r", detokenizer=SimpleNamespace(output_token_ids=[9, 9]))
    validate.keep_whole_request(state, token_rows(range(4)))  # 3 prompt + 2 output tokens: 4 rows
    assert check(state) is generated_only
    broken = token_rows(range(4))
    broken[2, 1] = broken[2, 1, 0]  # the same expert twice in one row of MoE layer 2
    validate.keep_whole_request(state, broken)
    with pytest.raises(validate.RoutingValidationError, match="layer 2 row 2: the same expert twice"):
        check(state)


def test_an_output_that_cannot_carry_the_rows_is_refused() -> None:
    """An async output (vLLM 0.21.0 refuses async scheduling with routed experts) has no routed_experts_dict: the
    step is refused, never shipped without rows."""
    runner, capture = FakeRunner(), prepared()
    ready(runner, capture)
    api = device_cache.DeviceCacheAdapter()
    scheduler_output = SimpleNamespace(
        finished_req_ids=set(), num_scheduled_tokens={"a": 2}, total_num_scheduled_tokens=2
    )
    api.step_started(runner, capture, scheduler_output)
    runner.input_batch.req_ids = ["a"]
    runner.requests["a"] = SimpleNamespace(block_ids=([1],))
    with pytest.raises(RuntimeError, match="has no routed_experts_dict"):
        api.sample(runner, capture, lambda: SimpleNamespace(sampled_token_ids_cpu=None))


def test_vllm_s_own_capturer_created_beside_the_plugin_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-ascend 0.21.0rc1's MoE method captures into vLLM's global capturer itself: it must be the no-op."""
    from vllm_ascend_routing import patching, runner_state

    runner = FakeRunner()
    runner.model = object()  # type: ignore[attr-defined]
    runner_state.set_prepared(runner, prepared())
    real = SimpleNamespace(get_device_cache=lambda: object())
    noop = SimpleNamespace(get_device_cache=lambda: None)
    init = device_cache._no_capturer(lambda self: None)
    monkeypatch.setattr(patching, "resolve", lambda target: lambda: noop)
    init(runner)
    assert runner.routed_experts_initialized is False  # type: ignore[attr-defined]
    monkeypatch.setattr(patching, "resolve", lambda target: lambda: real)
    with pytest.raises(RuntimeError, match="own capturer"):
        init(runner)
