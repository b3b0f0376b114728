# SPDX-License-Identifier: Apache-2.0
"""Backend ``ascend``: vllm-ascend's MoE layers route in its own ``select_experts``, never in ``BaseRouter``.

vllm-ascend (the ``select_experts`` design: 0.20.2rc1 to 0.25.x) calls
``vllm_ascend.ops.fused_moe.experts_selector.select_experts`` from its layer's ``forward_impl`` (the
multistream/flash-comm gate path) and from the ``apply`` of every MoE quant method (unquantized, W8A8,
W4A8, W4A16, MXFP…); only the unquantized one records routing itself. Every caller imported the function
by name into its own module. Where a function is defined is not where its class says it is (0.23.x
defines ``AscendFusedMoE`` in ``fused_moe_0_23_0`` and renames its ``__module__``), so the plugin finds
the call sites by the functions themselves: the global namespace (``__globals__``) of every function on
the layer's class, its MoE runner's, its quant method's and the scheme's, along their MROs. In each such
vllm-ascend namespace it replaces ``select_experts`` by a recording wrapper, and it wraps the layer's
``forward_impl`` (instance attribute) to mark the layer active while it runs. The wrapper records the ids
``select_experts`` returned: logical ids, because EPLB's ``log2phy`` mapping, zero experts and forced load
balancing are all applied later.

Fail loudly, never zeros: a layer whose forward finishes without ``select_experts`` having run raises
``RoutingNotRecordedError`` (checked in Python, no device synchronisation), and configurations that split
a step's tokens across tensor-parallel ranks before routing are refused at start-up.
"""

from __future__ import annotations

import contextvars
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm_ascend_routing.backends._layer import quant_method
from vllm_ascend_routing.capture import LayerCapture
from vllm_ascend_routing.compat.releases import Generation
from vllm_ascend_routing.patching import Patch

_ASCEND_RELEASES = "vllm-ascend 0.20.2rc1-0.25"
_GENERATIONS = (Generation.SHM, Generation.RUNNER_OUTPUT)  # vllm-ascend's select_experts design
SELECTOR = Patch(
    "vllm_ascend.ops.fused_moe.experts_selector:select_experts",
    "in the global namespace of every function that calls it (found through __globals__ of the functions of "
    "the layer's class, its MoE runner's and its quant method's, MROs included, not by __module__, which "
    "0.23.x renames): records the logical ids it returns (every quant method and the multistream gate path "
    "call it; none goes through BaseRouter)",
    "vllm-ascend routes every method through BaseRouter (its routers, 0.26+): use backend 'router'",
    _GENERATIONS,
    ("hidden_states", "router_logits", "top_k"),
    platform="npu",
    releases=_ASCEND_RELEASES,
)
FORWARD_IMPL = Patch(
    "vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE.forward_impl",
    "per bound layer (instance attribute): marks the layer active so select_experts knows its layer id",
    "as select_experts",
    _GENERATIONS,
    ("self", "hidden_states", "router_logits"),
    platform="npu",
    releases=_ASCEND_RELEASES,
)
PATCHES = (SELECTOR, FORWARD_IMPL)
_PACKAGE = SELECTOR.package
_SELECTOR = SELECTOR.target.rpartition(":")[2]
_FORWARD = FORWARD_IMPL.target.rpartition(".")[2]
_WRAPPED = "_vllm_ascend_routing_inner"


class RoutingNotRecordedError(RuntimeError):
    """A bound layer ran its forward without calling ``select_experts``: its rows would stay zero."""


class _LayerState:
    """One bound layer: its capture, and whether ``select_experts`` ran during its current forward."""

    __slots__ = ("capture", "name", "recorded")

    def __init__(self, capture: LayerCapture, name: str) -> None:
        self.capture = capture
        self.name = name
        self.recorded = False

    def record(self, topk_ids: torch.Tensor) -> None:
        top_k = self.capture.buffer.shape[2]
        if topk_ids.shape[-1] != top_k:
            if topk_ids.shape[-1] < top_k:
                raise RoutingNotRecordedError(
                    f"{self.name}: select_experts returned {topk_ids.shape[-1]} ids per token, the output "
                    f"holds top_k={top_k}."
                )
            # mix_placement appends the shared experts' ids after the routed ones: keep the routed ones.
            topk_ids = topk_ids[..., :top_k]
        self.capture(topk_ids)
        self.recorded = True


# The layer whose forward_impl is running (select_experts itself is not given the layer).
_active: contextvars.ContextVar[_LayerState | None] = contextvars.ContextVar("active_moe_layer", default=None)


def handles(module: torch.nn.Module) -> bool:
    """An MoE layer run by vllm-ascend: functions of its class, runner or quant method live in ``vllm_ascend``."""
    return callable(getattr(module, _FORWARD, None)) and bool(call_site_namespaces(module))


def bind(module: torch.nn.Module, capture: LayerCapture, name: str) -> None:
    """Record ``module``'s routing into ``capture``; rebinding replaces the capture, never stacks."""
    wrapped = [namespace for namespace in call_site_namespaces(module) if _wrap_selector(namespace)]
    if not wrapped:
        raise RoutingNotRecordedError(
            f"MoE layer {name!r} ({type(module).__name__}, quant method "
            f"{type(quant_method(module)).__name__}): none of its classes' functions calls "
            f"{_PACKAGE}'s {_SELECTOR}, so its routing cannot be recorded; this vllm-ascend release or "
            "quant method is not supported by vllm-ascend-routing."
        )
    method = quant_method(module)
    if not routes_with_selector(method):
        raise RoutingNotRecordedError(
            f"MoE layer {name!r}: quant method {type(method).__name__} routes without {_PACKAGE}'s "
            f"{_SELECTOR} (its apply, and the scheme it delegates to, never call it), so its routing cannot "
            "be recorded; this quant method is not supported by vllm-ascend-routing."
        )
    state = _LayerState(capture, name)
    current: Callable[..., Any] = getattr(module, _FORWARD)
    inner: Callable[..., Any] = getattr(current, _WRAPPED, current)

    def forward_impl(*args: Any, **kwargs: Any) -> Any:
        state.recorded = False
        token = _active.set(state)
        try:
            result = inner(*args, **kwargs)
        finally:
            _active.reset(token)
        if not state.recorded:
            raise RoutingNotRecordedError(
                f"{name}: the forward finished without calling {_SELECTOR}; its routed experts would be "
                "zeros. This vllm-ascend path (fused gating kernel, quant method) is not supported."
            )
        return result

    setattr(forward_impl, _WRAPPED, inner)
    setattr(module, _FORWARD, forward_impl)


def recording_selector(original: Callable[..., Any]) -> Callable[..., Any]:
    """``select_experts`` that also records the returned ids into the active layer (if any)."""

    def select_experts(*args: Any, **kwargs: Any) -> Any:
        topk_weights, topk_ids = original(*args, **kwargs)
        state = _active.get()
        if state is not None:
            state.record(topk_ids)
        return topk_weights, topk_ids

    setattr(select_experts, _WRAPPED, original)
    return select_experts


def _wrap_selector(namespace: dict[str, Any]) -> bool:
    """Replace ``select_experts`` in a module's namespace (idempotent); False if it has none."""
    selector = namespace.get(_SELECTOR)
    if not callable(selector):
        return False
    if not hasattr(selector, _WRAPPED):
        namespace[_SELECTOR] = recording_selector(selector)
    return True


def call_site_namespaces(module: torch.nn.Module) -> list[dict[str, Any]]:
    """The global namespaces, in ``vllm_ascend``, of every function defined on the layer's class, its MoE
    runner's, its quant method's and the scheme's (with their bases): where ``select_experts`` is looked
    up when the layer routes. Keyed by the function, not by ``cls.__module__``, which a class may rename."""
    namespaces: dict[str, dict[str, Any]] = {}
    for cls in _classes(module):
        for attribute in vars(cls).values():
            function = _function(attribute)
            if function is None:
                continue
            namespace = function.__globals__
            module_name = str(namespace.get("__name__", ""))
            if module_name.split(".")[0] == _PACKAGE:
                namespaces.setdefault(module_name, namespace)
    return list(namespaces.values())


def _function(attribute: Any) -> types.FunctionType | None:
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
        apply = _function(getattr(type(method), "apply", None))
        if apply is not None and _SELECTOR in _global_names(apply.__code__):
            return True
        method, depth = getattr(method, "quant_method", None) or getattr(method, "scheme", None), depth + 1
    return False


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # nested functions and comprehensions
            names |= _global_names(constant)
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


def splits_tokens(vllm_config: Any) -> bool:
    """Whether each TP rank's ``select_experts`` sees only its shard of the step's tokens.

    vllm-ascend splits tokens across tensor-parallel ranks before routing with expert parallel (MC2 /
    all-to-all) and with sequence parallelism (flash-comm); the capture then all-gathers the ids over TP.
    """
    tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    if tp == 1:
        return False
    return bool(getattr(vllm_config.parallel_config, "enable_expert_parallel", False)) or _ascend_sequence_parallel(
        vllm_config
    )


def _ascend_sequence_parallel(vllm_config: Any) -> bool:
    utils = sys.modules.get(f"{_PACKAGE}.utils")
    enable_sp = getattr(utils, "enable_sp", None)
    if callable(enable_sp):
        return bool(enable_sp(vllm_config))
    pass_config = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
    return bool(getattr(pass_config, "enable_sequence_parallelism", False))
