# SPDX-License-Identifier: Apache-2.0
"""Minimal fix so vLLM's CPU MoE runs at all where it would crash (see README "CPU compat fix").

vLLM's pure-PyTorch CPU MoE (``cpu_fused_moe._CPU_MOE_ACT_FN``, releases 0.20-0.27) builds a
``SiluAndMul`` CustomOp on every forward; outside vLLM's config context (always, at forward time) that
raises ``AssertionError: Current vLLM config is not set``. The table entry is replaced by the op's own
static ``SiluAndMul.forward_native`` (identical arithmetic, no object built). Only this entry changes.
Remove when: the lowest supported release no longer has ``_CPU_MOE_ACT_FN`` constructing the op.
"""

from __future__ import annotations

import importlib
import inspect


def apply() -> bool:
    """Patch the SiLU entry if this vLLM has the faulty table; returns whether anything changed."""
    try:
        cpu_fused_moe = importlib.import_module("vllm.model_executor.layers.fused_moe.cpu_fused_moe")
        activation = importlib.import_module("vllm.model_executor.layers.activation")
    except ImportError:
        return False
    table = getattr(cpu_fused_moe, "_CPU_MOE_ACT_FN", None)
    moe_activation = getattr(cpu_fused_moe, "MoEActivation", None)
    if table is None or moe_activation is None:
        return False
    silu = getattr(moe_activation, "SILU", None)
    if not isinstance(inspect.getattr_static(activation.SiluAndMul, "forward_native", None), staticmethod):
        return False  # needs an instance there: not the arithmetic-only function this fix relies on
    native = activation.SiluAndMul.forward_native
    if silu not in table or table[silu] is native:
        return False
    table[silu] = native
    return True
