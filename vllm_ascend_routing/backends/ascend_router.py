# SPDX-License-Identifier: Apache-2.0
"""Backend ``ascend_router``: vllm-ascend's router design (0.27.1rc1 on), where its MoE layer
(``AscendRoutedExperts``, driven by ``AscendMoERunner``) routes through a router that subclasses vLLM's
``BaseRouter`` (``AscendGroupedTopKRouter``, ``AscendFusedTopKRouter``, the 310P one, or vLLM's
``CustomRoutingRouter``).

``AscendRoutedExperts.forward_impl`` calls its ``_select_experts``, which calls ``router._select_experts``:
vLLM's template method computes the top-k (``_compute_routing``: native, the fused NPU gating kernel, or
DeepSeek-V4's hash / vision routing) and calls the router's ``capture_fn`` with the logical ids, before any
EPLB mapping; vllm-ascend applies ``log2phy``, mix_placement's shared-expert columns and forced load
balancing only after that. So the seam is the router's capture hook, as on CUDA, and every quant method is
covered (none of them routes: ``apply`` receives the ids). Checked at bind time from the bytecode: the
router's ``_select_experts`` calls ``capture_fn`` and the layer's ``_select_experts`` calls the router's. Each
layer's ``forward_impl`` is guarded (``_recorded``): a forward that did not reach the hook raises.

vllm-ascend's own capture (vLLM's binder handing ``router.set_capture_fn`` its capturer, whose ``capture`` it
patches for DP/SP/MC2) never runs: the plugin replaces vLLM's binder (``compat``), so each router holds the
plugin's capture only.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from vllm_ascend_routing.backends._recorded import LayerRecord, RoutingNotRecordedError, guard_forward
from vllm_ascend_routing.backends.ascend import ROUTING_SEAM, function_of, global_names
from vllm_ascend_routing.capture import LayerCapture
from vllm_ascend_routing.patching import RELY, Patch

__all__ = ["PATCHES", "bind", "handles"]

_RELEASES = "vllm-ascend 0.27.1rc1-0.30.0rc2"
# vllm-ascend's router design on vLLM's runner-output generation, and on the aux-output one (vLLM 0.31+, no
# vllm-ascend release yet): there the seam is verified too, and refused by name if it moved.
_VLLM = "0.27.1-"
ROUTED_SELECT = Patch(
    "vllm_ascend.ops.fused_moe.routed_experts:AscendRoutedExperts._select_experts",
    "relied on: calls router._select_experts (vLLM's BaseRouter template, which calls the router's capture_fn "
    "with logical ids) before log2phy, mix_placement and forced balancing",
    "never (the router seam is vLLM's own)",
    params=("self", "hidden_states", "router_logits"),
    vllm=_VLLM,
    platform="npu",
    required=False,
    one_of=ROUTING_SEAM,
    releases=_RELEASES,
    action=RELY,
)
ROUTED_FORWARD = Patch(
    "vllm_ascend.ops.fused_moe.routed_experts:AscendRoutedExperts.forward_impl",
    "per bound layer (instance attribute): raises if a forward finished without reaching the capture hook",
    "never",
    params=("self",),
    vllm=_VLLM,
    platform="npu",
    required=False,
    releases=_RELEASES,
    action=RELY,
)
PATCHES = (ROUTED_SELECT, ROUTED_FORWARD)
_PACKAGE = ROUTED_SELECT.package
_SELECT = ROUTED_SELECT.target.rpartition(".")[2]
_FORWARD = ROUTED_FORWARD.target.rpartition(".")[2]
_CAPTURE_HOOK = "capture_fn"


def _routed_experts(module: torch.nn.Module) -> Any:
    """The module that routes: the runner's ``routed_experts`` (the model holds the runner), or the module."""
    return getattr(module, "routed_experts", None) or module


def _own_function(cls: type, name: str) -> types.FunctionType | None:
    """``cls.<name>`` as the MRO resolves it, when that function is defined in ``vllm_ascend``."""
    for klass in cls.__mro__:
        if name in vars(klass):
            function = function_of(vars(klass)[name])
            if function is None:
                return None
            package = str(function.__globals__.get("__name__", "")).split(".")[0]
            return function if package == _PACKAGE else None
    return None


def handles(module: torch.nn.Module) -> bool:
    """An MoE layer of vllm-ascend's router design: its routed-experts module's ``_select_experts`` is
    vllm-ascend's, and its router takes a capture hook."""
    routed = _routed_experts(module)
    router = getattr(routed, "router", None) or getattr(module, "router", None)
    return (
        callable(getattr(router, "set_capture_fn", None))
        and callable(getattr(routed, _FORWARD, None))
        and _own_function(type(routed), _SELECT) is not None
    )


def bind(module: torch.nn.Module, capture: LayerCapture, name: str) -> None:
    """Hand the layer's router the capture (replacing any hook it had); guard the layer's forward."""
    routed = _routed_experts(module)
    router = getattr(routed, "router", None) or getattr(module, "router", None)
    if router is None:
        raise RoutingNotRecordedError(f"MoE layer {name!r} ({type(routed).__name__}) has no router to hook.")
    select = _own_function(type(routed), _SELECT)
    if select is None or "_select_experts" not in global_names(select.__code__):
        raise RoutingNotRecordedError(
            f"MoE layer {name!r} ({type(routed).__name__}): its {_SELECT} does not call its router's "
            "_select_experts, so the router's capture hook never sees its routing; this vllm-ascend release is "
            "not supported by vllm-ascend-routing."
        )
    router_select = function_of(getattr(type(router), "_select_experts", None))
    if router_select is None or _CAPTURE_HOOK not in global_names(router_select.__code__):
        raise RoutingNotRecordedError(
            f"MoE layer {name!r}: router {type(router).__name__}'s _select_experts never calls {_CAPTURE_HOOK} "
            "(it overrides vLLM's BaseRouter template), so its routing cannot be recorded; this router is not "
            "supported by vllm-ascend-routing."
        )
    record = LayerRecord(capture, name)
    router.set_capture_fn(record)
    guard_forward(routed, _FORWARD, record, None, f"reaching {type(router).__name__}'s {_CAPTURE_HOOK}")
