# SPDX-License-Identifier: Apache-2.0
"""Minimal fix so vLLM's CPU MoE runs at all where it would crash (see README "CPU compat fix").

vLLM's pure-PyTorch CPU MoE (``cpu_fused_moe._CPU_MOE_ACT_FN``, releases 0.20-0.27) builds a
``SiluAndMul`` CustomOp on every forward; outside vLLM's config context (always, at forward time) that
raises ``AssertionError: Current vLLM config is not set``. The table entry is replaced (``patching.wrap``) by a call
of the op's own static ``SiluAndMul.forward_native`` (identical arithmetic, no object built). Only this entry changes.
Remove when: the lowest supported release no longer has ``_CPU_MOE_ACT_FN`` constructing the op.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from vllm_ascend_routing import patching
from vllm_ascend_routing.patching import RELY, Patch, resolve
from vllm_ascend_routing.releases import Generation

ACTIVATION_TABLE = Patch(
    "vllm.model_executor.layers.fused_moe.cpu_fused_moe:_CPU_MOE_ACT_FN",
    "CPU compat fix: SiluAndMul built at forward time outside the config context (its SILU entry replaced)",
    "the lowest supported vLLM is 0.28.0 or newer",
    (Generation.SHM, Generation.DEVICE_CACHE, Generation.RUNNER_OUTPUT),
    platform="cpu",
    required=False,
    releases="vLLM 0.20.0-0.27.1",
    action=RELY,
)
PATCHES = (ACTIVATION_TABLE,)
_MODULE = ACTIVATION_TABLE.target.partition(":")[0]


def apply() -> bool:
    """Patch the SiLU entry if this vLLM has the faulty table; returns whether anything changed."""
    try:
        table = resolve(ACTIVATION_TABLE.target)
        moe_activation = resolve(f"{_MODULE}:MoEActivation")
        activation = resolve("vllm.model_executor.layers.activation:SiluAndMul")
    except LookupError:
        return False
    silu = getattr(moe_activation, "SILU", None)
    if not isinstance(inspect.getattr_static(activation, "forward_native", None), staticmethod):
        return False  # needs an instance there: not the arithmetic-only function this fix relies on
    native = activation.forward_native
    if silu not in table or patching.is_wrapped(table[silu]):
        return False
    patching.wrap(table, silu, lambda _: _silu_and_mul(native))
    return True


def _silu_and_mul(native: Callable[..., Any]) -> Callable[..., Any]:
    """The table entry: the op's own arithmetic, called without building the op (a function of this package,
    so it can carry ``patching``'s marker; ``native`` is vLLM's and stays unmarked)."""

    def silu_and_mul(*args: Any, **kwargs: Any) -> Any:
        return native(*args, **kwargs)

    return silu_and_mul
