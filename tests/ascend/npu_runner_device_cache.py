# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.21.0's device-cache generation on vllm-ascend 0.21.0rc1's V1 runner, for ``npu_runner_step``: the runner's
own routed-experts statements run as written around real MoE forwards, through the hooks installed on the class,
over steps that mix prefills, a decode and a chunked prefill; each sampling request's shipped rows against the
reference rows of its positions not shipped before."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.ascend.npu_runner_step import (
    Block,
    _watch_vllm_ascend_capture,
    call_through_class,
    forward_layers,
    routed_experts_blocks,
    run_block,
)

# vLLM 0.21.0 (device-cache): per step, each request's (id, positions computed before, positions scheduled, whether
# it samples). Step 1: "a"'s prompt, the first chunk of "b"'s; step 2: "c"'s prompt, "a" decodes, "b"'s last chunk
# (its first chunk's rows read back from the store after "c" wrote its own: filed under another request's slots,
# they would be "c"'s).
DEVICE_CACHE_STEPS = (
    (("a", 0, 3, True), ("b", 0, 2, False)),
    (("c", 0, 2, True), ("a", 3, 1, True), ("b", 2, 2, True)),
)
ATTENTION_BLOCKS = {"a": [2], "b": [5], "c": [1]}  # KV blocks of each request in the attention group


def device_cache_steps(
    runner: Any,
    module: Any,
    layers: dict[int, Any],
    kv_config: Any,
    args: Any,
    result: dict[str, Any],
    patch: pytest.MonkeyPatch,
) -> list[dict[str, Any]]:
    """vLLM 0.21.0 on vllm-ascend 0.21.0rc1's V1 runner: the runner's own routed-experts statements (vLLM 0.21.0's
    capturer creation in ``initialize_kv_cache``, its step-start ``finalize_pending_copy``, its device-to-host copy
    and ``extract_routed_experts_for_current_batch`` in ``sample_tokens``) run as written, around real MoE forwards,
    through the hooks installed on the class; ``sample_tokens`` returns the ``ModelRunnerOutput`` the runner builds
    (``routed_experts_dict`` from its statements), which the plugin's hook fills."""
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer as upstream

    blocks = routed_experts_blocks(type(runner))
    create = [b for b in blocks if "init_routed_experts_capturer()" in b.text]
    start = [b for b in blocks if b.method == "execute_model"]
    after = [b for b in blocks if b.method == "sample_tokens"]
    result["blocks"] = {"create": [b.method for b in create], "start": [b.method for b in start],
                        "after": [b.method for b in after]}  # fmt: skip
    scope: dict[str, Any] = {"self": runner}

    def initialize_kv_cache(self: Any, config: Any, *a: Any, **k: Any) -> None:
        for block in create:
            run_block(block, module, scope)

    result["initialize_kv_cache_wraps"] = call_through_class(runner, "initialize_kv_cache", initialize_kv_cache,
                                                             kv_config)  # fmt: skip
    result["routed_experts_initialized"] = runner.routed_experts_initialized
    own = upstream.get_global_experts_capturer()
    result["capturer"] = type(own).__name__
    result["vllm_ascend_binder_ran"] = any(
        "_ascend_routed_experts_capturer" in vars(part) for moe in layers.values() for part in (moe.layer, moe.experts)
    )
    own_calls: list[int] = []  # layer ids vllm-ascend's MoE method hands vLLM's global capturer itself
    original_capture = own.capture
    patch.setattr(own, "capture", lambda layer_id, topk_ids: (own_calls.append(layer_id), original_capture(
        layer_id=layer_id, topk_ids=topk_ids))[1])  # fmt: skip
    result["vllm_ascend_capture_calls"] = _watch_vllm_ascend_capture(patch)
    attention = 1 if args.hybrid else 0
    state = DeviceCacheRun(runner, module, layers, start, after, scope, args.hybrid)
    steps = [state.step(batch) for batch in DEVICE_CACHE_STEPS]
    result["attention_group"] = attention
    result["store_group"] = runner._vllm_ascend_routing_device_cache.group  # the KV group the plugin files rows by
    result["vllm_ascend_own_capture_layer_ids"] = own_calls
    result["vllm_ascend_capture_calls"] = result["vllm_ascend_capture_calls"]()
    return steps


@dataclass
class DeviceCacheRun:
    """vLLM 0.21.0's steps on the runner (``device_cache_steps``), and each request's reference rows so far."""

    runner: Any
    module: Any
    layers: dict[int, Any]
    start: list[Block]  # the runner's own statements at the top of execute_model
    after: list[Block]  # ... and in sample_tokens
    scope: dict[str, Any]
    hybrid: bool
    rows: dict[str, dict[int, list[Any]]] = field(default_factory=dict)  # request -> position -> MoE rows
    sent: dict[str, int] = field(default_factory=dict)  # request -> positions the plugin should have shipped
    requests: dict[str, Any] = field(default_factory=dict)
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(7))

    def step(self, batch: tuple[tuple[str, int, int, bool], ...]) -> dict[str, Any]:
        from vllm.v1.outputs import ModelRunnerOutput

        for request, *_ in batch:  # a linear-attention state block first in the hybrid layout
            blocks = ([7], ATTENTION_BLOCKS[request]) if self.hybrid else (ATTENTION_BLOCKS[request],)
            self.requests.setdefault(request, SimpleNamespace(block_ids=blocks))
        req_ids = [r for r, *_ in batch]
        self.runner.requests = self.requests
        self.runner.input_batch = SimpleNamespace(
            req_ids=req_ids, num_computed_tokens_cpu=np.array([c for _, c, _, _ in batch])
        )
        num_tokens = sum(n for _, _, n, _ in batch)
        scheduler_output = SimpleNamespace(
            total_num_scheduled_tokens=num_tokens,
            num_scheduled_tokens={r: n for r, _, n, _ in batch},
            finished_req_ids=set(),
            scheduled_spec_decode_tokens={},
        )
        scope = {**self.scope, "scheduler_output": scheduler_output}
        outputs: list[Any] = []
        moe_columns = sorted(self.layers)

        def execute_model(runner: Any, output: Any, *a: Any, **k: Any) -> None:
            for block in self.start:
                run_block(block, self.module, scope)
            forward = forward_layers(self.layers, num_tokens, self.generator)
            offset = 0
            for request, computed, scheduled, _ in batch:
                for i in range(scheduled):
                    self.rows.setdefault(request, {})[computed + i] = forward[offset + i][moe_columns].tolist()
                offset += scheduled

        def sample_tokens(runner: Any, *a: Any, **k: Any) -> Any:
            scope.update(req_ids_output_copy=req_ids, routed_experts_dict=None)
            for block in self.after:
                run_block(block, self.module, scope)
            outputs.append(ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[7] if samples else [] for *_, samples in batch],
                routed_experts_dict=scope["routed_experts_dict"],  # as the runner's statements left it
            ))  # fmt: skip
            return outputs[-1]

        wraps = [
            call_through_class(self.runner, "execute_model", execute_model, scheduler_output),
            call_through_class(self.runner, "sample_tokens", sample_tokens, None),
        ]
        expected: dict[str, Any] = {}
        for request, computed, scheduled, samples in batch:
            if samples:
                end = computed + scheduled
                expected[request] = [self.rows[request][p] for p in range(self.sent.get(request, 0), end)]
                self.sent[request] = end
        shipped = outputs[0].routed_experts_dict or {}
        return {
            "wraps": wraps,
            "expected": expected,
            "shipped": {r: np.asarray(a).astype(np.int64).tolist() for r, a in shipped.items()},
            "shipped_dtypes": sorted({str(np.asarray(a).dtype) for a in shipped.values()}),
        }
