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

    def forward_torch(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      activation: str = "silu") -> torch.Tensor:
        self.calls += 1
        return x + 1


class FakeQuantMethod:
    def __init__(self, cpu: bool) -> None:
        self.is_monolithic = cpu
        if cpu:
            self.cpu_fused_moe = FakeCPUFusedMoE()


class FakeMoE(torch.nn.Module):
    def __init__(self, layer_id: int, cpu: bool) -> None:
        super().__init__()
        self.layer_name = f"model.layers.{layer_id}.mlp.experts"
        self.layer_id = layer_id
        self.router = FakeRouter()
        self.quant_method = FakeQuantMethod(cpu)


class FakeModel(torch.nn.Module):
    """``num_layers`` decoder layers; those in ``moe_layers`` are MoE, the others dense."""

    def __init__(self, cpu: bool, moe_layers: tuple[int, ...] = (0, 2), num_layers: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [FakeMoE(i, cpu) if i in moe_layers else torch.nn.Linear(2, 2) for i in range(num_layers)]
        )
