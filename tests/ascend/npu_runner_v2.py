# SPDX-License-Identifier: Apache-2.0
"""vllm-ascend's NPU Model Runner V2, for ``npu_runner_step``: vLLM's MRV2 routed-experts statements, which the NPU
runner inherits, run as written around real MoE forwards through the hooks installed on the class; the rows its
async output copies and converts, by slot, against the reference."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tests.ascend.npu_runner_step import (
    STEPS,
    VLLM_V2_RUNNER,
    Block,
    call_through_class,
    forward_layers,
    group_slot_mappings,
    routed_experts_blocks,
    run_block,
)


def v2_steps(
    runner: Any, layers: dict[int, Any], config: Any, hybrid: bool, result: dict[str, Any]
) -> list[dict[str, Any]]:
    """The NPU Model Runner V2: vLLM's MRV2 routed-experts statements, which it inherits."""
    vllm_v2 = importlib.import_module(VLLM_V2_RUNNER)
    blocks = [b for b in routed_experts_blocks(vllm_v2.GPUModelRunner) if b.method == "execute_model"]
    result["blocks"] = {"execute": [b.text.splitlines()[0] for b in blocks]}
    return [step_v2(runner, layers, vllm_v2, blocks, hybrid, *step) for step in STEPS]


def step_v2(
    runner: Any,
    layers: dict[int, Any],
    vllm_v2: Any,
    blocks: list[Block],
    hybrid: bool,
    num_tokens: int,
    slots: list[int],
) -> dict[str, Any]:
    groups = group_slot_mappings(slots, num_tokens, hybrid)
    scope = {"self": runner, "dummy_run": False, "slot_mappings": torch.stack(groups), "num_toks": num_tokens}
    generator = torch.Generator().manual_seed(num_tokens)
    expected: list[Any] = []
    shipped: list[Any] = []

    def execute_model(self: Any, output: Any, *a: Any, **k: Any) -> None:
        expected.append(forward_layers(layers, num_tokens, generator))
        for block in blocks:
            run_block(block, vllm_v2, scope)

    def sample_tokens(self: Any, *a: Any, **k: Any) -> None:  # AsyncOutput: copy, then convert
        shipped.append(scope["routed_experts"].to_cpu_nonblocking().tolists())

    scheduler_output = SimpleNamespace(total_num_scheduled_tokens=num_tokens)
    wraps = [
        call_through_class(runner, "execute_model", execute_model, scheduler_output),
        call_through_class(runner, "sample_tokens", sample_tokens, None),
    ]
    (lists,) = shipped
    return {
        "expected": expected[0].tolist(),
        "slots": slots,
        "wraps": wraps,
        "shipped_rows": np.asarray(lists.routing_data).astype(np.int64).tolist(),
        "shipped_dtype": str(np.asarray(lists.routing_data).dtype),
        "shipped_slots": np.asarray(lists.slot_mapping).astype(np.int64).tolist(),
    }
