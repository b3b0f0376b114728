# SPDX-License-Identifier: Apache-2.0
"""Backend ``zero_expert_router``: vLLM's ``ZeroExpertRouter`` (LongCat-Flash's zero / identity experts).

Its ``_compute_routing`` takes the top-k over routed *and* zero experts, hands a copy of those ids to
``zero_experts_compute_triton`` (the zero experts' output), then overwrites every zero-expert id with 0 (and its
weight with 0) before ``BaseRouter`` calls the capture hook. vLLM's own capture therefore returns expert 0 for a
zero expert, possibly twice in a row, and a token routed only to zero experts as a row of zeros. This backend
records the ids ``zero_experts_compute_triton`` receives instead: every choice as what it is, zero experts as
ids ``[num_experts, num_experts + zero_experts)``. The router's hook is left unset, so the masked ids never
overwrite them. A ``_compute_routing`` that no longer passes its ids there raises instead of recording nothing.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch

from vllm_ascend_routing import patching
from vllm_ascend_routing.capture import LayerCapture
from vllm_ascend_routing.patching import Patch

_MODULE = "vllm.model_executor.layers.fused_moe.router.zero_expert_router"
ZERO_EXPERT_IDS = Patch(
    f"{_MODULE}:zero_experts_compute_triton",
    "zero-expert routers: record the ids before the router overwrites zero experts with expert 0",
    "vLLM's capture hook receives zero experts' own ids",
    params=("expert_indices",),
    required=False,
)
PATCHES = (ZERO_EXPERT_IDS,)

# The capture of the zero-expert router computing its routing now (set around its ``_compute_routing``).
_active: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("zero_expert_capture", default=None)


class _Recording:
    """One layer's capture, and whether the current routing reached it."""

    __slots__ = ("capture", "recorded")

    def __init__(self, capture: LayerCapture) -> None:
        self.capture = capture
        self.recorded = False


def handles(module: torch.nn.Module) -> bool:
    router = getattr(module, "router", None)
    return type(router).__name__ == "ZeroExpertRouter" and type(router).__module__ == _MODULE


def zero_experts(module: torch.nn.Module) -> int:
    """The router scores routed and zero experts together: its score bias has one entry per id."""
    router = getattr(module, "router")  # noqa: B009 (nn.Module attribute typing)
    return int(router.e_score_correction_bias.numel()) - int(router.num_logical_experts)


def bind(module: torch.nn.Module, capture: LayerCapture, name: str) -> None:
    patching.replace(ZERO_EXPERT_IDS, _recording_zero_experts)
    router: Any = getattr(module, "router")  # noqa: B009
    patching.wrap(
        router, "_compute_routing", lambda compute: _recording_routing(compute, _Recording(capture), name), rebind=True
    )
    router.set_capture_fn(None)  # its hook would see the masked ids


def _recording_routing(compute: Callable[..., Any], recording: _Recording, name: str) -> Callable[..., Any]:
    def compute_routing(*args: Any, **kwargs: Any) -> Any:
        recording.recorded = False
        token = _active.set(recording)
        try:
            result = compute(*args, **kwargs)
        finally:
            _active.reset(token)
        if not recording.recorded:
            raise RuntimeError(
                f"vllm-ascend-routing: the zero-expert router of {name} computed its routing without passing "
                "its ids to zero_experts_compute_triton, where the plugin records them; refusing instead of "
                "returning zeros. Unset VLLM_ASCEND_ROUTING and report the vLLM release."
            )
        return result

    return compute_routing


def _recording_zero_experts(compute: Callable[..., Any]) -> Callable[..., Any]:
    def zero_experts_compute_triton(*args: Any, **kwargs: Any) -> Any:
        recording = _active.get()
        if recording is not None:
            recording.capture(kwargs["expert_indices"] if "expert_indices" in kwargs else args[0])
            recording.recorded = True
        return compute(*args, **kwargs)

    return zero_experts_compute_triton
