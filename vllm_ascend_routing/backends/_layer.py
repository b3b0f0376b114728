# SPDX-License-Identifier: Apache-2.0
"""What every backend reads off an MoE layer."""

from __future__ import annotations

from typing import Any

import torch


def quant_method(module: torch.nn.Module) -> Any:
    """The layer's MoE quant method (``quant_method``; some releases keep it as ``_quant_method``)."""
    return getattr(module, "quant_method", None) or getattr(module, "_quant_method", None)


def is_vllm_ascend_layer(module: torch.nn.Module) -> bool:
    """Whether the layer (or the routed-experts module it drives) is vllm-ascend's: such a layer is recorded by
    an Ascend backend or refused, never by vLLM's router hook, which vllm-ascend's own MoE may never call."""
    parts = (module, getattr(module, "routed_experts", None))
    return any(part is not None and type(part).__module__.split(".")[0] == "vllm_ascend" for part in parts)
