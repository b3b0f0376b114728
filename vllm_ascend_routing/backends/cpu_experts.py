# SPDX-License-Identifier: Apache-2.0
"""Backend ``cpu_experts``: vLLM's monolithic CPU experts (0.28, 0.29) route inside the kernel.

In those releases the CPU MoE is a ``FusedMoEExpertsMonolithic`` (``fused_moe/experts/cpu_moe.py``,
reached as ``quant_method.moe_kernel.fused_experts``): its ``apply`` computes routing with its own
``_select_experts`` and never calls the router, and vLLM's own capturer refuses such kernels. We wrap
that method on each bound layer's experts object, as the ``cpu_moe`` backend wraps ``forward_method``:
the ids it returns are the logical top-k that the kernel then uses. Quantized CPU experts that call the
module-level ``select_experts`` instead have no ``_select_experts`` and are left unbound (refused).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_ascend_routing import patching
from vllm_ascend_routing.backends._layer import quant_method
from vllm_ascend_routing.capture import LayerCapture

_OWNER = "_vllm_ascend_routing_owner"


class SharedExpertsError(RuntimeError):
    """Two MoE layers share one experts object: one wrapper cannot tell their rows apart."""


def _experts(module: torch.nn.Module) -> Any:
    qm = quant_method(module)
    if qm is None or not getattr(qm, "is_monolithic", False):
        return None
    return getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)


def handles(module: torch.nn.Module) -> bool:
    return callable(getattr(_experts(module), "_select_experts", None))


def bind(module: torch.nn.Module, capture: LayerCapture, name: str) -> None:
    experts = _experts(module)
    current = experts._select_experts
    owner = getattr(current, _OWNER, None)
    if owner is not None and owner != id(module):
        raise SharedExpertsError(
            f"{type(experts).__name__} is shared by two MoE layers; their routing cannot be told apart. "
            "Report the model architecture to vllm-ascend-routing."
        )
    patching.wrap(experts, "_select_experts", lambda inner: _recording(inner, capture, id(module)), rebind=True)


def _recording(inner: Callable[..., Any], capture: LayerCapture, owner: int) -> Callable[..., Any]:
    def select_experts(*args: Any, **kwargs: Any) -> Any:
        topk_weights, topk_ids = inner(*args, **kwargs)
        capture(topk_ids)
        return topk_weights, topk_ids

    setattr(select_experts, _OWNER, owner)
    return select_experts
