# SPDX-License-Identifier: Apache-2.0
"""Backend ``cpu_moe``: vLLM's CPU fused MoE (releases up to 0.27) bypasses ``BaseRouter``.

``UnquantizedFusedMoEMethod`` on the CPU is monolithic: ``CPUFusedMOE.__call__`` runs the module-level
``cpu_fused_moe.select_experts`` and passes the ids to its ``forward_method(layer, x, topk_weights,
topk_ids, ...)``. We wrap that per-instance attribute of each bound layer, so only target layers record,
and the wrapper stays plain traceable Python under ``torch.compile``. This is the same situation as
Ascend's ``select_experts``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_ascend_routing import patching
from vllm_ascend_routing.backends._layer import quant_method
from vllm_ascend_routing.capture import LayerCapture
from vllm_ascend_routing.patching import RELY, Patch

FORWARD_METHOD = Patch(
    "vllm.model_executor.layers.fused_moe.cpu_fused_moe:CPUFusedMOE",
    "per bound layer, the instance's forward_method is wrapped to record the ids the CPU MoE computed itself",
    "the lowest supported vLLM is 0.28.0 or newer (CPU MoE routes through BaseRouter)",
    vllm="0.20.0-0.27.1",
    platform="cpu",
    required=False,
    releases="vLLM 0.20.0-0.27.1",
    action=RELY,
)
PATCHES = (FORWARD_METHOD,)


def _cpu_impl(module: torch.nn.Module) -> Any:
    return getattr(quant_method(module), "cpu_fused_moe", None)


def handles(module: torch.nn.Module) -> bool:
    return _cpu_impl(module) is not None


def bind(module: torch.nn.Module, capture: LayerCapture, name: str) -> None:
    impl = _cpu_impl(module)
    forward = getattr(impl, "forward_method", None)
    if forward is None:
        raise RuntimeError(
            f"{type(impl).__name__} (VLLM_CPU_SGL_KERNEL=1) does not expose its top-k ids to the "
            "routed-experts capture; unset VLLM_CPU_SGL_KERNEL to use vLLM's default CPU MoE."
        )
    patching.wrap(impl, "forward_method", lambda inner: _recording(inner, capture), rebind=True)


def _recording(inner: Callable[..., torch.Tensor], capture: LayerCapture) -> Callable[..., torch.Tensor]:
    def forward_method(
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        capture(topk_ids)
        return inner(layer, x, topk_weights, topk_ids, *args, **kwargs)

    return forward_method
