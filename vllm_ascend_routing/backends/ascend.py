# SPDX-License-Identifier: Apache-2.0
"""Backend ``ascend``: vllm-ascend's ``select_experts`` design (0.20.2rc1 to 0.26.0rc1), where MoE layers route
in vllm-ascend's own ``select_experts``, never in ``BaseRouter``.

vllm-ascend calls ``vllm_ascend.ops.fused_moe.experts_selector.select_experts`` from the ``apply`` of every MoE
quant method (unquantized, W8A8, W4A8, W4A16, MXFP…) and from its layer's multistream/flash-comm gate path;
only the unquantized one records routing itself. Every caller imported the function by name into its own
module. Where a function is defined is not where its class says it is (0.23.x defines ``AscendFusedMoE`` in
``fused_moe_0_23_0`` and renames its ``__module__``), so the plugin finds the call sites by the functions
themselves: the global namespace (``__globals__``) of every function on the layer's class, its MoE runner's,
its quant method's and the scheme's, along their MROs. In each such vllm-ascend namespace it replaces
``select_experts`` by a recording wrapper, and it wraps the layer's MoE forward (instance attribute) to mark
the layer active while it runs: ``AscendFusedMoE.forward_impl`` up to 0.23.x, ``AscendMoERunner._forward_impl``
from 0.24.0rc1 (the runner is the layer there: vLLM's ``FusedMoE`` factory returns it). The wrapper records
the ids ``select_experts`` returned: logical ids, because EPLB's ``log2phy`` mapping, zero experts and forced
load balancing are all applied later.

Fail loudly, never zeros: a layer whose forward finishes without ``select_experts`` having run raises
``RoutingNotRecordedError`` (``_recorded``; checked in Python, no device synchronisation).
"""

from __future__ import annotations

import contextvars
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm_ascend_routing import patching
from vllm_ascend_routing.backends._layer import quant_method
from vllm_ascend_routing.backends._recorded import (
    LayerRecord,
    RoutingNotRecordedError,
    guard_forward,
)
from vllm_ascend_routing.capture import LayerCapture
from vllm_ascend_routing.patching import RELY, Patch

__all__ = ["PATCHES", "RoutingNotRecordedError", "bind", "handles"]

# vllm-ascend's select_experts design (0.20.2rc1 on vLLM 0.20.2, 0.21.0rc1 on 0.21.0, then 0.22.1rc1 to 0.26.0rc1)
_VLLM = "0.20.2-0.26.0"
# vllm-ascend's routing seam: one of these exists in every supported release (this module's or ascend_router's).
ROUTING_SEAM = "vllm-ascend's routing seam"
SELECTOR = Patch(
    "vllm_ascend.ops.fused_moe.experts_selector:select_experts",
    "in the global namespace of every function that calls it (found through __globals__ of the functions of "
    "the layer's class, its MoE runner's and its quant method's, MROs included, not by __module__, which "
    "0.23.x renames): records the logical ids it returns (every quant method and the multistream gate path "
    "call it; none goes through BaseRouter)",
    "vllm-ascend routes every method through BaseRouter (its routers, 0.27.1rc1+): backend 'ascend_router'",
    params=("hidden_states", "router_logits", "top_k"),
    vllm=_VLLM,
    platform="npu",
    required=False,
    one_of=ROUTING_SEAM,
    releases="vllm-ascend 0.20.2rc1-0.26.0rc1",
    action=RELY,
)
LAYER_FORWARD = Patch(
    "vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE.forward_impl",
    "per bound layer (instance attribute): marks the layer active so select_experts knows its layer id",
    "as select_experts",
    params=("self", "hidden_states", "router_logits"),
    vllm="0.20.2-0.23.0",
    platform="npu",
    required=False,
    releases="vllm-ascend 0.20.2rc1-0.23.0.post1",
    action=RELY,
)
RUNNER_FORWARD = Patch(
    "vllm_ascend.ops.fused_moe.fused_moe:AscendMoERunner._forward_impl",
    "per bound layer (instance attribute; the runner is the layer from 0.24.0rc1): marks the layer active so "
    "select_experts knows its layer id",
    "as select_experts",
    params=("self", "hidden_states", "router_logits"),
    vllm="0.24.0-0.26.0",
    platform="npu",
    required=False,
    releases="vllm-ascend 0.24.0rc1-0.26.0rc1",
    action=RELY,
)
PATCHES = (SELECTOR, LAYER_FORWARD, RUNNER_FORWARD)
_PACKAGE = SELECTOR.package
_SELECTOR = SELECTOR.target.rpartition(":")[2]
# The MoE forward that runs select_experts: the layer's own (up to 0.23.x) or, where the runner is the layer,
# the runner's entry point (0.24.0rc1-0.26.0rc1).
_FORWARDS = (LAYER_FORWARD.target.rpartition(".")[2], RUNNER_FORWARD.target.rpartition(".")[2])

# The layer whose forward is running (select_experts itself is not given the layer).
_active: contextvars.ContextVar[LayerRecord | None] = contextvars.ContextVar("active_moe_layer", default=None)


def _forward_name(module: torch.nn.Module) -> str | None:
    return next((name for name in _FORWARDS if callable(getattr(module, name, None))), None)


def handles(module: torch.nn.Module) -> bool:
    """An MoE layer of vllm-ascend's select_experts design: it has one of the MoE forwards above, and a
    function of its class, runner or quant method reads ``select_experts`` from a ``vllm_ascend`` namespace."""
    if _forward_name(module) is None:
        return False
    return any(callable(namespace.get(_SELECTOR)) for namespace in call_site_namespaces(module))


def zero_experts(module: torch.nn.Module) -> int:
    """Zero experts the layer routes to (LongCat-Flash): its ``select_experts`` returns their ids after the
    routed experts', recorded as they are before ``zero_experts_compute`` folds them away. Read where the
    quant method's ``apply`` reads them: the layer, or (0.24-0.26: the runner is the layer) its routed experts."""
    for owner in (module, getattr(module, "routed_experts", None)):
        if owner is not None and getattr(owner, "zero_expert_type", None) is not None:
            return int(getattr(owner, "zero_expert_num", 0) or 0)
    return 0


def bind(module: torch.nn.Module, capture: LayerCapture, name: str) -> None:
    """Record ``module``'s routing into ``capture``; rebinding replaces the capture, never stacks."""
    wrapped = [namespace for namespace in call_site_namespaces(module) if _wrap_selector(namespace)]
    forward = _forward_name(module)
    if not wrapped or forward is None:
        raise RoutingNotRecordedError(
            f"MoE layer {name!r} ({type(module).__name__}, quant method "
            f"{type(quant_method(module)).__name__}): none of its classes' functions calls "
            f"{_PACKAGE}'s {_SELECTOR}, or it has no MoE forward ({' / '.join(_FORWARDS)}), so its routing "
            "cannot be recorded; this vllm-ascend release or quant method is not supported by vllm-ascend-routing."
        )
    method = quant_method(module)
    if not routes_with_selector(method):
        raise RoutingNotRecordedError(
            f"MoE layer {name!r}: quant method {type(method).__name__} routes without {_PACKAGE}'s "
            f"{_SELECTOR} (its apply, and the scheme it delegates to, never call it), so its routing cannot "
            "be recorded; this quant method is not supported by vllm-ascend-routing."
        )
    guard_forward(module, forward, LayerRecord(capture, name), _active, f"calling {_SELECTOR}")


def recording_selector(original: Callable[..., Any]) -> Callable[..., Any]:
    """``select_experts`` that also records the returned ids into the active layer (if any)."""

    def select_experts(*args: Any, **kwargs: Any) -> Any:
        topk_weights, topk_ids = original(*args, **kwargs)
        record = _active.get()
        if record is not None:
            record(topk_ids)
        return topk_weights, topk_ids

    return select_experts


def _wrap_selector(namespace: dict[str, Any]) -> bool:
    """Replace ``select_experts`` in a module's namespace (idempotent, ``patching.wrap``); False if it has none."""
    if not callable(namespace.get(_SELECTOR)):
        return False
    patching.wrap(namespace, _SELECTOR, recording_selector)
    return True


def call_site_namespaces(module: torch.nn.Module) -> list[dict[str, Any]]:
    """The global namespaces, in ``vllm_ascend``, of every function defined on the layer's class, its MoE
    runner's, its quant method's and the scheme's (with their bases): where ``select_experts`` is looked
    up when the layer routes. Keyed by the function, not by ``cls.__module__``, which a class may rename."""
    namespaces: dict[str, dict[str, Any]] = {}
    for cls in _classes(module):
        for attribute in vars(cls).values():
            function = function_of(attribute)
            if function is None:
                continue
            namespace = function.__globals__
            module_name = str(namespace.get("__name__", ""))
            if module_name.split(".")[0] == _PACKAGE:
                namespaces.setdefault(module_name, namespace)
    return list(namespaces.values())


def function_of(attribute: Any) -> types.FunctionType | None:
    """The plain function behind a class attribute (method, static/class method, property getter)."""
    if isinstance(attribute, (staticmethod, classmethod)):
        attribute = attribute.__func__
    elif isinstance(attribute, property):
        attribute = attribute.fget
    if not callable(attribute):
        return None
    attribute = inspect.unwrap(attribute)
    return attribute if isinstance(attribute, types.FunctionType) else None


def routes_with_selector(method: Any) -> bool:
    """Whether the quant method's ``apply`` (or that of the scheme it delegates to) calls ``select_experts``.

    Read from the bytecode of the ``apply`` the method really runs (inherited ones included), so a method
    that routes another way is refused at bind time, not found out by the per-forward guard.
    """
    depth = 0
    while method is not None and depth < 3:
        apply = function_of(getattr(type(method), "apply", None))
        if apply is not None and _SELECTOR in global_names(apply.__code__):
            return True
        method, depth = getattr(method, "quant_method", None) or getattr(method, "scheme", None), depth + 1
    return False


def global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # nested functions and comprehensions
            names |= global_names(constant)
    return names


def _classes(module: torch.nn.Module) -> Iterator[type]:
    yield from type(module).__mro__
    moe_runner = getattr(module, "runner", None)  # vllm-ascend 0.23+: AscendMoERunner drives forward_impl
    if moe_runner is not None:
        yield from type(moe_runner).__mro__
    method, depth = quant_method(module), 0
    while method is not None and depth < 3:  # AscendFusedMoEMethod -> scheme (one level today)
        yield from type(method).__mro__
        method, depth = getattr(method, "quant_method", None) or getattr(method, "scheme", None), depth + 1
