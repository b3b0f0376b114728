# SPDX-License-Identifier: Apache-2.0
"""Fake vLLM MoE layers (router or CPU-MoE routed) for tests that need no vLLM install."""

from __future__ import annotations

from typing import Any

import torch


class FakeRouter:
    def __init__(self) -> None:
        self.capture_fn: Any = None

    def set_capture_fn(self, fn: Any) -> None:
        self.capture_fn = fn


class FakeCPUFusedMoE:
    def __init__(self) -> None:
        self.calls = 0
        self.forward_method = self.forward_torch

    def forward_torch(
        self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu"
    ) -> torch.Tensor:
        self.calls += 1
        return x + 1


class FakeMonolithicCPUExperts:
    """vLLM 0.28-0.29's ``CPUUnquantizedExperts``: ``apply`` routes with its own ``_select_experts``."""

    def __init__(self) -> None:
        self.calls = 0

    def _select_experts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights, ids = torch.topk(router_logits, k=2, dim=-1)
        return weights, ids.to(torch.int32)

    def apply(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        _, topk_ids = self._select_experts(hidden_states, router_logits)
        return hidden_states + topk_ids.sum(dim=-1, keepdim=True)


class FakeMoEKernel:
    def __init__(self, experts: FakeMonolithicCPUExperts) -> None:
        self.fused_experts = experts


class FakeQuantMethod:
    def __init__(self, cpu: bool, cpu_experts: bool = False) -> None:
        self.is_monolithic = cpu or cpu_experts
        self.cpu, self.cpu_experts = cpu, cpu_experts
        self.processed = 0
        self.process_weights_after_loading(None)

    def process_weights_after_loading(self, layer: Any) -> None:
        """As vLLM's CPU MoE does on every (re)load: new kernel objects (a weight update included)."""
        self.processed += 1
        if self.cpu:
            self.cpu_fused_moe = FakeCPUFusedMoE()
        if self.cpu_experts:
            self.moe_kernel = FakeMoEKernel(FakeMonolithicCPUExperts())


class FakeMoE(torch.nn.Module):
    def __init__(self, layer_id: int, cpu: bool, cpu_experts: bool = False) -> None:
        super().__init__()
        self.layer_name = f"model.layers.{layer_id}.mlp.experts"
        self.layer_id = layer_id
        self.router = FakeRouter()
        self.quant_method = FakeQuantMethod(cpu, cpu_experts)


class FakeModel(torch.nn.Module):
    """``num_layers`` decoder layers; those in ``moe_layers`` are MoE, the others dense."""

    def __init__(
        self, cpu: bool, moe_layers: tuple[int, ...] = (0, 2), num_layers: int = 3, cpu_experts: bool = False
    ) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [FakeMoE(i, cpu, cpu_experts) if i in moe_layers else torch.nn.Linear(2, 2) for i in range(num_layers)]
        )


class BufferedModel(torch.nn.Module):
    """A model with a weight and a registered buffer of its own (as vLLM's rotary embedding's cache), for what vLLM's
    sleep mode saves and restores."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        self.register_buffer("cos_sin_cache", torch.arange(6, dtype=torch.float32), persistent=False)
