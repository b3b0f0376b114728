# SPDX-License-Identifier: Apache-2.0
"""The replay bridge: vLLM's ``routed_experts`` arrays to the tensors a trainer's routers replay.

For the trainer process; NumPy and torch only, never vLLM (the runtime plugin never imports this module).

    samples = [align(out.routed_experts, len(prompt_ids), len(output_ids)) for ...]  # one per sample, no copy
    replay = to_megatron(samples, moe_layers(hf_config), num_experts, shard=...)    # packed (THD), this rank's
    set_model_targets(model, replay)                                                  # Megatron-Core

:func:`align` places a request's array on the token axis (row ``t`` = token ``t`` of ``prompt + output``)
without copying it; :func:`to_megatron` copies the rank's rows of its MoE layers, in a narrow dtype, into one
`[num_moe_layers, N, top_k]` block with a mask of the rows that hold recorded routing, and
:func:`set_model_targets` hands each of the model's own routers its layer's rows, found by the router's
``layer_number`` and widened to int64 on the router's device, with the rows outside the mask left to the
router's own top-k. :class:`Shard` names one trainer rank's part (DP samples, pipeline layers, CP and SP rows);
:class:`Conversation` and :func:`share_prompt` keep each row once across a multi-turn conversation and across
a GRPO group. On an engine with a row store, :func:`fetch` returns a key's array, :func:`open_rows` its lazy
form (what :func:`align` makes of a key: :func:`to_megatron` then reads the rank's slice only) and :func:`release`
frees keys. :func:`check_alignment` compares the rows with the trainer's own routing of the same tokens and
refuses a shifted token axis before training. :func:`moe_layers` and :func:`check` are validation mode's own
(``vllm_ascend_routing.contract``).
"""

from __future__ import annotations

from vllm_ascend_routing.contract import UnknownMoELayersError, Violation, from_device_cache, moe_layers
from vllm_ascend_routing.replay.aligned import (
    ROW_CONTRACTS,
    Aligned,
    AlignmentError,
    Conversation,
    RowContract,
    SharedPrompt,
    align,
    check,
    share_prompt,
)
from vllm_ascend_routing.replay.megatron import (
    check_alignment,
    keep_native,
    model_routers,
    recorded_routes,
    set_model_targets,
)
from vllm_ascend_routing.replay.nemo_rl import for_nemo_rl
from vllm_ascend_routing.replay.pack import MegatronReplay, Shard, to_megatron
from vllm_ascend_routing.store import MalformedKeyError, StoreError, UnknownKeyError
from vllm_ascend_routing.store.reader import fetch, open_rows, release

__all__ = [
    "ROW_CONTRACTS",
    "AlignmentError",
    "Aligned",
    "Conversation",
    "MalformedKeyError",
    "MegatronReplay",
    "RowContract",
    "Shard",
    "StoreError",
    "UnknownKeyError",
    "SharedPrompt",
    "UnknownMoELayersError",
    "Violation",
    "align",
    "check",
    "from_device_cache",
    "check_alignment",
    "fetch",
    "open_rows",
    "release",
    "for_nemo_rl",
    "keep_native",
    "model_routers",
    "moe_layers",
    "recorded_routes",
    "set_model_targets",
    "share_prompt",
    "to_megatron",
]
