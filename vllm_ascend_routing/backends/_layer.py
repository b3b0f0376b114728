# SPDX-License-Identifier: Apache-2.0
"""What every backend reads off an MoE layer."""

from __future__ import annotations

from typing import Any

import torch


def quant_method(module: torch.nn.Module) -> Any:
    """The layer's MoE quant method (``quant_method``; some releases keep it as ``_quant_method``)."""
    return getattr(module, "quant_method", None) or getattr(module, "_quant_method", None)
