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
  * when vLLM creates its capturer, ``_bind_routed_experts_capturer`` (0.22-0.27) or the module function
    ``bind_routed_experts_capturer(model, capturer)`` the runners import (0.28-0.30, both runners) hands
    it that buffer instead of binding layers.

SCAFFOLDING: remove when the lowest supported vLLM is >= 0.31 (AuxOutput connector only).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.capture import PreparedCapture
from vllm_ascend_routing.compat._common import bind_target_model, rank_layout, refuse_unsupported_config
from vllm_ascend_routing.compat.base import Generation, StepHooksNotUsed
from vllm_ascend_routing.runner_mixin import binding_runner

logger = get_logger(__name__)

# Runner modules that import the module-level binder (0.28-0.30); absent names are skipped.
_BINDER_IMPORTERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
_BINDER = "bind_routed_experts_capturer"
_PATCHED = "_vllm_ascend_routing_patched"


def _bind_through_runner(model: torch.nn.Module, capturer: Any) -> None:
    """Stands in for vLLM's module-level binder: route to the runner's (mixin) bind hook."""
    runner = binding_runner()
    if runner is None or runner.model is not model:
        raise RuntimeError(
            "vllm-ascend-routing: routed-experts binding called outside a patched model runner's "
            "init_routed_experts_capturer(); this runner class is not supported."
        )
    runner._bind_routed_experts_capturer(capturer)


setattr(_bind_through_runner, _PATCHED, True)


class RunnerOutputAPI(StepHooksNotUsed):
    generation = Generation.RUNNER_OUTPUT

    def install(self) -> None:
        for name in _BINDER_IMPORTERS:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(module, _BINDER):
                setattr(module, _BINDER, _bind_through_runner)

    def install_ascend(self) -> None:
        """Nothing: vllm-ascend's runner ships vLLM's capturer buffer itself (the mixin replaces its
        ``_bind_routed_experts_capturer``, so its own per-layer capturer attribute stays unset)."""

    def check_config(self, vllm_config: Any) -> None:
        refuse_unsupported_config(vllm_config, self.generation.value)

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

    def prepare(self, model: torch.nn.Module, vllm_config: Any, device: torch.device) -> PreparedCapture | None:
        if not vllm_config.model_config.enable_return_routed_experts:
            return None
        self.check_config(vllm_config)
        num_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        return bind_target_model(model, num_tokens, self.routing_shape(vllm_config), device, rank_layout(vllm_config))

    def after_forward(self, prepared: PreparedCapture, num_tokens: int) -> None:
        """Nothing: vLLM's runner copies the buffer to the host itself, asynchronously."""

    def attach(self, prepared: PreparedCapture, capturer: Any) -> None:
        # Done before the runner allocates its pinned host mirror (which copies this dtype) and
        # before any graph capture; never reallocated.
        upstream = capturer.device_buffer
        if tuple(upstream.shape) != tuple(prepared.buffer.shape) or upstream.device != prepared.buffer.device:
            raise RuntimeError(
                f"vllm-ascend-routing: vLLM's capturer buffer {tuple(upstream.shape)} on {upstream.device} "
                f"does not match the prepared {tuple(prepared.buffer.shape)} on {prepared.buffer.device}."
            )
        capturer.device_buffer = prepared.buffer
