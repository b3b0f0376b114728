# SPDX-License-Identifier: Apache-2.0
"""Steps every generation adapter shares (``interface.Adapter.prepare`` and the generations' own): config refusals,
load-time binding, the shape-checked attach."""

from __future__ import annotations

from typing import Any

import torch

from vllm_ascend_routing import backends, kv, sleep_mode
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.capture import (
    LayerCapture,
    PreparedCapture,
    check_id_range,
    new_capture_buffer,
    new_error_counter,
)
from vllm_ascend_routing.compat._runners import GROUP_0_SNAPSHOT_MODULES
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.parallel import RankLayout

logger = get_logger(__name__)

_PARALLELISM_REFUSED = {
    "pipeline_parallel_size": "pipeline parallelism",
    "decode_context_parallel_size": "decode context parallelism",
    "prefill_context_parallel_size": "prefill context parallelism",
}


def prepare_capture(
    model: torch.nn.Module,
    vllm_config: Any,
    device: torch.device,
    shape: tuple[int, int, int],
    *,
    generation: str,
    narrowed_by_expert_count: bool,
    kv_rows: kv.KvRows | None,
) -> PreparedCapture:
    """At model load, for an engine of ``generation`` that returns routed experts (``Adapter.prepare``): refuse what
    cannot be served exactly (its name in the messages; ``narrowed_by_expert_count``: ``refuse_unrepresentable_ids``;
    ``kv_rows``: the generation's store of loaded rows, ``None``: KV connectors refused), then bind the target model's
    MoE layers to a ``[max_num_batched_tokens, *shape[:2]]`` buffer."""
    refuse_unsupported_config(vllm_config, generation, kv_rows)
    num_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
    prepared = bind_target_model(model, num_tokens, shape, device, rank_layout(vllm_config))
    refuse_unrepresentable_ids(prepared, narrowed_by_expert_count)
    sleep_mode.keep_through_sleep(model, prepared)  # restored by vLLM's wake-up after a level-2 sleep
    return prepared


def refuse_unrepresentable_ids(prepared: PreparedCapture, narrowed_by_expert_count: bool) -> None:
    """Where the generation's array is narrowed by the routed expert count (uint8 up to 256 experts), refuse
    zero experts' ids that would wrap there."""
    if narrowed_by_expert_count and prepared.num_experts <= 256 < prepared.id_range:
        raise UnsupportedVllmError(
            f"vllm-ascend-routing: this model's zero experts have ids up to {prepared.id_range - 1}, but vLLM sizes "
            f"its routed-experts array for {prepared.num_experts} routed experts (uint8): ids from 256 on would "
            "wrap. No released model has this layout; report it, or unset VLLM_ASCEND_ROUTING."
        )


def attach_buffer(prepared: PreparedCapture, capturer: Any) -> None:
    """Hand vLLM's capturer the prepared buffer in place of the one it allocated (same shape and device), then
    let vLLM's binder bind the layers left to it.

    Done before the runner allocates anything derived from it (pinned host mirrors, snapshots) and before
    any graph capture; never reallocated."""
    upstream = capturer.device_buffer
    if tuple(upstream.shape) != tuple(prepared.buffer.shape) or upstream.device != prepared.buffer.device:
        raise RuntimeError(
            f"vllm-ascend-routing: vLLM's capturer buffer {tuple(upstream.shape)} on {upstream.device} "
            f"does not match the prepared {tuple(prepared.buffer.shape)} on {prepared.buffer.device}."
        )
    capturer.device_buffer = prepared.buffer
    # Layers only vLLM's binder can bind, bound by it now, into that same buffer (``backends.upstream``).
    backends.upstream.bind(prepared.deferred, capturer)


def attention_kv_group(runner: Any) -> int:
    """The KV cache group whose slots key routed-experts rows, as vLLM's runner computed it (0.20-0.27: the
    runner's ``routed_experts_attn_gid``; 0.28+: its capturer's ``attn_gid``)."""
    gid = getattr(runner, "routed_experts_attn_gid", None)
    if gid is None:
        gid = getattr(getattr(runner, "routed_experts_capturer", None), "attn_gid", None)
    return int(gid or 0)


def misplaced_slot_group(runner: Any) -> int | None:
    """The attention group whose slots the runner should have snapshotted, where it snapshots group 0
    instead (a runner class marked ``snapshots_kv_group_0``, on a hybrid model); ``None`` where its snapshot
    is right. Such a runner files rows under group 0's slots, where the scheduler reads them back by the
    attention group's: in hybrid models (Qwen3.5, Qwen3-Next: linear-attention groups first) they differ."""
    gid = attention_kv_group(runner)
    if gid == 0 or not any(cls.__module__ in GROUP_0_SNAPSHOT_MODULES for cls in type(runner).__mro__):
        return None
    return gid


def refuse_unsupported_config(vllm_config: Any, generation: str, kv_rows: kv.KvRows | None = None) -> None:
    """Raise for parallel layouts and KV connectors whose routing rows this plugin cannot place exactly
    (``kv_rows``: the generation's store of loaded rows; ``None``: every KV connector is refused)."""
    parallel = vllm_config.parallel_config
    for attr, what in _PARALLELISM_REFUSED.items():
        size = getattr(parallel, attr, 1) or 1
        if size > 1:
            raise UnsupportedVllmError(
                f"vllm-ascend-routing: {what} ({attr}={size}) is not supported with routed-experts capture on "
                f"vLLM's {generation} API; set {attr}=1 or unset VLLM_ASCEND_ROUTING."
            )
    if getattr(parallel, "enable_dbo", False):
        raise UnsupportedVllmError(
            "vllm-ascend-routing: dual batch overlap (--enable-dbo) runs a step as micro-batches whose MoE "
            "layers each see only their own tokens, and the capture writes every micro-batch from row 0; "
            "remove --enable-dbo or unset VLLM_ASCEND_ROUTING."
        )
    backends.refuse_unsupported_config(vllm_config)
    kv.refuse_uncovered(vllm_config, generation, kv_rows, kv.RELIED)  # connectors whose loaded rows are not carried


def rank_layout(vllm_config: Any) -> RankLayout | None:
    """This engine's DP rank and TP split, or ``None`` where every router sees exactly this rank's tokens."""
    parallel = vllm_config.parallel_config
    dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    # vLLM's sequence-parallel MoE (EP, TP > 1, DP > 1) or vllm-ascend's MC2 / all-to-all / flash-comm.
    split = bool(getattr(parallel, "use_sequence_parallel_moe", False)) or backends.splits_tokens(vllm_config)
    if dp_size == 1 and not (split and tp_size > 1):
        return None
    return RankLayout(int(getattr(parallel, "data_parallel_rank", 0) or 0), tp_size, split and tp_size > 1)


def bind_target_model(
    model: torch.nn.Module,
    num_tokens: int,
    shape: tuple[int, int, int],
    device: torch.device,
    layout: RankLayout | None = None,
) -> PreparedCapture:
    """Allocate the static ``[num_tokens, num_layers, top_k]`` buffer and bind every MoE layer to it.

    Args:
        shape: ``(num_hidden_layers, top_k, num_experts)`` as the generation's output defines them.
        layout: this engine's DP rank / TP split (``rank_layout``): each layer records only its own rank's
            tokens, assembled over TP where the MoE split them.
    """
    num_layers, top_k, num_experts = shape
    buffer = new_capture_buffer(num_tokens, num_layers, top_k, num_experts, device)
    errors = new_error_counter(device)
    layer_ids: list[int] = []
    id_range = num_experts

    def make_capture(layer_id: int, zero_experts: int) -> LayerCapture:
        nonlocal id_range
        if not 0 <= layer_id < num_layers:
            raise backends.UnboundLayerError(
                f"MoE layer id {layer_id} is outside the {num_layers} hidden layers of the output."
            )
        layer_ids.append(layer_id)
        id_range = max(id_range, num_experts + zero_experts)
        check_id_range(id_range)
        # Zero experts' ids follow the routed experts': recorded as what they are, not as invalid.
        return LayerCapture(buffer, layer_id, num_experts + zero_experts, errors, layout)

    deferred: list[torch.nn.Module] = []

    def defer(layer_id: int, module: torch.nn.Module) -> None:
        if not 0 <= layer_id < num_layers:
            raise backends.UnboundLayerError(
                f"MoE layer id {layer_id} is outside the {num_layers} hidden layers of the output."
            )
        layer_ids.append(layer_id)
        deferred.append(module)

    bound = backends.bind_model(model, make_capture, defer)
    prepared = PreparedCapture.bound(buffer, errors, num_experts, tuple(layer_ids), id_range, tuple(deferred))
    count = sum(bound.values())
    logger.info(
        "routed-experts capture bound to %d MoE layers at load (backend %s): buffer %s %s, %d experts, %s",
        count,
        ", ".join(f"{backend} x{layers}" for backend, layers in sorted(bound.items())),
        tuple(buffer.shape),
        str(buffer.dtype).removeprefix("torch."),
        num_experts,
        "single rank" if layout is None else layout,
    )
    if id_range > num_experts:
        logger.info(
            "zero experts recorded as ids %d-%d (after the %d routed experts)", num_experts, id_range - 1, num_experts
        )
    if not prepared.sentinel.checks_zero_rows:
        logger.info("top-1 routing: all-zero rows are expert 0, not a bypass; only invalid ids are checked")
    return prepared
