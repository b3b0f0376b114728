# SPDX-License-Identifier: Apache-2.0
"""Generation ``runner-output``: vLLM 0.22.0-0.30.0 (vLLM PR #39568, per-runner capturer).

vLLM's runner owns the transport: it snapshots the step's attention slot mapping, copies
``capturer.device_buffer[:num_tokens]`` to a pinned host buffer (non-blocking, joined with the step's
existing sync) and ships ``RoutedExpertsLists`` on ``ModelRunnerOutput.routed_experts``; the scheduler's
``RoutedExpertsManager`` stores rows by KV slot and returns uint8/uint16
``[num_tokens - 1 - prompt_start, num_hidden_layers, top_k]``. This adapter only replaces the binding:
  * at model load (before vLLM compiles the model during profiling), target-model MoE layers only are
    bound, through whichever backend routes them (``backends``), to a static int16 buffer (half the bytes
    of upstream's int32 per step), written by the ``record_topk_ids`` custom op;
  * when vLLM creates its capturer, its binder (the runner method, or the module function the runners
    import: ``releases.BINDER_METHOD`` / ``BINDER_FUNCTION``) hands it that buffer instead of binding layers.

SCAFFOLDING: remove when the lowest supported vLLM is >= 0.31 (AuxOutput connector only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_ascend_routing import patching
from vllm_ascend_routing.capture import PreparedCapture
from vllm_ascend_routing.compat._common import attach_buffer, misplaced_slot_group
from vllm_ascend_routing.compat._runners import CAPTURER_BINDER, CAPTURER_HOOKS, RUNNER_CLASSES
from vllm_ascend_routing.compat.interface import (
    Adapter,
    Generation,
    RunnerClass,
    RunnerHook,
    UnsupportedVllmError,
)
from vllm_ascend_routing.compat.runner_output.kv_rows import SlotRows
from vllm_ascend_routing.patching import Patch
from vllm_ascend_routing.releases import BINDER_FUNCTION, BINDER_METHOD
from vllm_ascend_routing.runner_state import binding_runner

# The module-level binder (0.28-0.30 here), as each runner module imported it; absent in older releases.
_BINDER_WHY = "vLLM's module-level binder, as the runner imported it, routes to the runner's bind hook"
PATCHES = (
    Patch(f"vllm.v1.worker.gpu_model_runner:{BINDER_FUNCTION}", _BINDER_WHY,
          "the lowest supported vLLM is 0.31.0 or newer", (Generation.RUNNER_OUTPUT,), ("model", "capturer"),
          required=False, one_of=CAPTURER_BINDER, releases="vLLM 0.28.0-0.30.0"),
    Patch(f"vllm.v1.worker.gpu.model_runner:{BINDER_FUNCTION}", _BINDER_WHY + " (Model Runner V2)",
          "the lowest supported vLLM is 0.31.0 or newer", (Generation.RUNNER_OUTPUT,), ("model", "capturer"),
          required=False, releases="vLLM 0.28.0-0.30.0"),
)  # fmt: skip


def _bind_through_runner(model: torch.nn.Module, capturer: Any) -> None:
    """Stands in for vLLM's module-level binder: route to the runner's (mixin) bind hook."""
    runner = binding_runner()
    if runner is None or runner.model is not model:
        raise RuntimeError(
            "vllm-ascend-routing: routed-experts binding called outside a patched model runner's "
            "init_routed_experts_capturer(); this runner class is not supported."
        )
    getattr(runner, BINDER_METHOD)(capturer)


_V2_CAPTURER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner.init_routed_experts_capturer"
_SLOT_GROUP = "_vllm_ascend_routing_slot_group"  # runner attribute: the KV group whose slots to re-snapshot


def _v2_runner_captures() -> bool:
    try:
        patching.resolve(_V2_CAPTURER)
    except LookupError:
        return False
    return True


class RunnerOutputAdapter(Adapter):
    patches = (*PATCHES, *SlotRows.patches)
    per_request_output = True  # rows start at routed_experts_prompt_start, sent per request through the engine core
    generation = Generation.RUNNER_OUTPUT
    runner_hooks: tuple[RunnerHook, ...] = CAPTURER_HOOKS
    runner_classes: Mapping[str, tuple[RunnerClass, ...]] = RUNNER_CLASSES
    rows_read_in_front_end = False  # rows travel in vLLM's runner output
    narrowed_by_expert_count = True  # vLLM returns the array as uint8 where the routed experts fit it
    kv_rows = SlotRows()  # rows of tokens a KV connector loaded: in the scheduler's slot buffer (``kv``)

    def install(self) -> None:
        for patch in PATCHES:
            patching.replace(patch, lambda _: _bind_through_runner)

    def install_ascend(self) -> None:
        """Nothing: vllm-ascend's runner ships vLLM's capturer buffer itself (the mixin replaces its
        ``_bind_routed_experts_capturer``, so its own per-layer capturer attribute stays unset)."""

    def routing_shape(self, vllm_config: Any) -> tuple[int, int, int]:
        """``(num_hidden_layers, top_k, num_experts)`` exactly as this generation's capturer sizes them."""
        model_config = vllm_config.model_config
        if hasattr(model_config, "get_num_experts_per_tok"):  # 0.28+
            num_layers = model_config.get_total_num_hidden_layers()
            top_k = model_config.get_num_experts_per_tok()
        else:  # 0.22-0.27: the capturer reads the HF text config
            from vllm.model_executor.layers.fused_moe import routed_experts_capturer as upstream

            num_layers = model_config.hf_text_config.num_hidden_layers
            top_k = upstream._get_num_experts_per_tok(model_config.hf_text_config)
        return int(num_layers), int(top_k), int(model_config.get_num_experts())

    def refuse_before_binding(self, vllm_config: Any) -> None:
        if getattr(vllm_config, "use_v2_model_runner", False) and not _v2_runner_captures():
            raise UnsupportedVllmError(
                "vllm-ascend-routing: this vLLM's Model Runner V2 has no routed-experts capture (vLLM 0.28.0 "
                "added it; on 0.26-0.27 it would return no routed experts, and vllm-ascend 0.27.1rc1's V2 runner "
                "fails at start-up); unset VLLM_USE_V2_MODEL_RUNNER or unset VLLM_ASCEND_ROUTING."
            )

    def after_forward(self, runner: Any, prepared: PreparedCapture, num_tokens: int) -> None:
        """vLLM's runner copies the buffer to the host itself, asynchronously. Where the runner snapshotted
        another KV group's slot mapping (``misplaced_slot_group``), the snapshot is re-taken from the attention
        group's, before ``sample_tokens`` ships it: one device-to-device copy, no synchronisation."""
        gid = getattr(runner, _SLOT_GROUP, None)
        if gid is not None and num_tokens:
            source = runner.input_batch.block_table[gid].slot_mapping.gpu
            runner.routed_experts_slot_mapping_device[:num_tokens].copy_(source[:num_tokens])

    def attach(self, runner: Any, prepared: PreparedCapture, capturer: Any) -> None:
        attach_buffer(prepared, capturer)  # before the runner allocates its pinned host mirror of it
        setattr(runner, _SLOT_GROUP, misplaced_slot_group(runner))
