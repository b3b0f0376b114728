# SPDX-License-Identifier: Apache-2.0
"""Fail loudly, never zeros: a bound layer's forward that finishes without having recorded its routing raises.

vllm-ascend routes outside vLLM's own call graph (its ``select_experts``, or its routers called from its own
``forward_impl``), so a path the plugin does not intercept (a fused gating kernel, a new quant method, a
routed-experts class that overrides the router call) would leave the layer's rows zero. Each bound layer's
forward (an instance attribute, so only target-model layers are affected) clears a flag, runs, and checks
that the layer recorded; the check is a Python boolean, no device synchronisation.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch

from vllm_ascend_routing import patching
from vllm_ascend_routing.capture import LayerCapture


class RoutingNotRecordedError(RuntimeError):
    """A bound layer ran its forward without its routing being recorded: its rows would stay zero."""


class LayerRecord:
    """One bound layer: its capture, and whether its routing was recorded during its current forward."""

    __slots__ = ("capture", "name", "recorded")

    def __init__(self, capture: LayerCapture, name: str) -> None:
        self.capture = capture
        self.name = name
        self.recorded = False

    def __call__(self, topk_ids: torch.Tensor) -> None:
        top_k = self.capture.buffer.shape[2]
        if topk_ids.shape[-1] != top_k:
            if topk_ids.shape[-1] < top_k:
                raise RoutingNotRecordedError(
                    f"{self.name}: routing returned {topk_ids.shape[-1]} ids per token, the output holds top_k={top_k}."
                )
            # mix_placement appends the shared experts' ids after the routed ones: keep the routed ones.
            topk_ids = topk_ids[..., :top_k]
        self.capture(topk_ids)
        self.recorded = True


def guard_forward(
    module: torch.nn.Module,
    method: str,
    record: LayerRecord,
    active: contextvars.ContextVar[LayerRecord | None] | None,
    missing: str,
) -> None:
    """Wrap ``module.<method>`` (an instance attribute, through ``patching.wrap``) so that it raises when the
    forward finished without ``record`` having run; rebinding replaces the wrapper, never stacks it.

    Args:
        active: set to ``record`` while the forward runs (where the recording call site is not given the
            layer), or ``None``.
        missing: the end of the error message (what the forward did not call).
    """
    patching.wrap(module, method, lambda inner: _guarded(inner, record, active, missing), rebind=True)


def _guarded(
    inner: Callable[..., Any],
    record: LayerRecord,
    active: contextvars.ContextVar[LayerRecord | None] | None,
    missing: str,
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        record.recorded = False
        token = active.set(record) if active is not None else None
        try:
            result = inner(*args, **kwargs)
        finally:
            if token is not None:
                active.reset(token)  # type: ignore[union-attr]
        if not record.recorded:
            raise RoutingNotRecordedError(
                f"{record.name}: the forward finished without {missing}; its routed experts would be zeros. "
                "This vllm-ascend path (fused gating kernel, quant method, MoE class) is not supported."
            )
        return result

    return forward
