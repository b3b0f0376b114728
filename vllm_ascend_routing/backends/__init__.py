# SPDX-License-Identifier: Apache-2.0
"""Bind every MoE layer of a target model to a ``LayerCapture``, through the backend that routes it.

Backends (one module each) answer one question: for this MoE layer, where can its logical top-k ids be
intercepted? ``ascend``: vllm-ascend's own ``select_experts`` (its select_experts design,
0.20.2rc1-0.26.0rc1: its MoE layers never call the router). ``ascend_router``: vllm-ascend's routers (its
router design, 0.27.1rc1 on), checked and guarded like ``ascend``. ``cpu_moe``: vLLM's CPU fused MoE
(releases up to 0.27), which computes routing itself and never calls the router. ``cpu_experts``: vLLM's
monolithic CPU experts (0.28, 0.29), likewise. ``zero_expert_router``: vLLM's ``ZeroExpertRouter``
(LongCat-Flash), whose capture hook sees zero experts already overwritten with expert 0. ``router``: vLLM's
``BaseRouter`` capture hook. Layers vLLM's own binder records from inside its kernels (capture sources,
monolithic kernels with replay capture, vLLM 0.28+) are left to that binder (``upstream``), never refused.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.backends import (
    _rebind,
    ascend,
    ascend_config,
    ascend_router,
    cpu_experts,
    cpu_moe,
    router,
    upstream,
    zero_expert_router,
)
from vllm_ascend_routing.backends._layer import quant_method
from vllm_ascend_routing.backends._rebind import bind_again_after_processing
from vllm_ascend_routing.capture import LayerCapture
from vllm_ascend_routing.context import InstallContext

__all__ = [
    "BACKENDS",
    "NEEDS",
    "PATCHES",
    "Backend",
    "UnboundLayerError",
    "bind_model",
    "install",
    "moe_layers",
    "quant_method",
    "refuse_unsupported_config",
    "splits_tokens",
]

logger = get_logger(__name__)


class Backend(Protocol):
    """One place a layer's logical top-k ids can be intercepted (a module of this package)."""

    def handles(self, module: torch.nn.Module) -> bool: ...

    def bind(self, module: torch.nn.Module, capture: LayerCapture, name: str) -> None: ...


# Ordered: the first backend that handles a layer binds it. vllm-ascend's layers and vLLM's CPU MoE kernels
# compute routing themselves (their routers exist but are never called), so they come before the router;
# vllm-ascend's router layers come before vLLM's router for their bind-time checks and forward guard.
BACKENDS: tuple[tuple[str, Backend], ...] = (
    ("ascend", ascend),
    ("ascend_router", ascend_router),
    ("cpu_moe", cpu_moe),
    ("cpu_experts", cpu_experts),
    ("zero_expert_router", zero_expert_router),
    ("router", router),
)


# The backends as a feature of the registry (``features.FEATURES``): what they rely on or wrap per layer in vLLM and
# vllm-ascend. Nothing is installed process-wide: each layer is bound at model load (``bind_model``).
PATCHES = (
    *cpu_moe.PATCHES,
    *_rebind.PATCHES,  # bound layers bound again after their weights are processed again
    *zero_expert_router.PATCHES,
    *ascend.PATCHES,
    *ascend_router.PATCHES,
)
NEEDS: tuple[str, ...] = ()


def install(ctx: InstallContext) -> None:
    """Nothing process-wide: layers are bound at model load, through the capture feature's ``load_model`` hook."""


class UnboundLayerError(RuntimeError):
    """An MoE layer exists whose routing the plugin cannot intercept: refusing beats zeros."""


def moe_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, int]]:
    """``(name, module, layer_id)`` for each MoE layer of ``model`` (one per router).

    Walks ``model.modules()`` (the target model only, never vLLM's ``static_forward_context``, which
    also holds draft/MTP layers whose layer ids collide with the target's).
    """
    seen: set[int] = set()
    for name, module in model.named_modules():
        moe_router = getattr(module, "router", None)
        if moe_router is None or not isinstance(getattr(module, "layer_name", None), str):
            continue
        if id(moe_router) in seen:
            continue  # e.g. FusedMoE and its MoERunner share one router
        seen.add(id(moe_router))
        yield name, module, _layer_id(name, module)


def _layer_id(name: str, module: torch.nn.Module) -> int:
    layer_id = getattr(module, "layer_id", None)
    if isinstance(layer_id, int):
        return layer_id
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return int(extract_layer_index(module.layer_name))
    except (AssertionError, ValueError) as exc:
        raise UnboundLayerError(
            f"MoE layer {name!r} ({module.layer_name!r}) has no layer id; its routing cannot be "
            "placed. Report the model architecture to vllm-ascend-routing."
        ) from exc


def bind_model(
    model: torch.nn.Module,
    make_capture: Callable[[int, int], LayerCapture],
    defer: Callable[[int, torch.nn.Module], None] | None = None,
) -> dict[str, int]:
    """Bind each MoE layer of the target ``model``; returns how many layers each backend bound.

    ``make_capture(layer_id, zero_experts)``: the layer's capture; ``zero_experts`` is how many zero experts
    the backend records for it (their ids follow the routed experts'), 0 for most models.
    ``defer(layer_id, module)``: takes a layer vLLM's own binder records and no backend here can
    (``upstream.defers``), for that binder to bind later; without it such a layer is refused. Counted as
    ``vllm``.

    Two steps, in this order: every MoE layer (one per router) through its backend or left to vLLM; then the
    modules vLLM binds by their own ``capture_fn`` outside those layers, on layer ids no backend recorded.

    Raises:
        UnboundLayerError: for a layer no backend can intercept, or a model with no MoE layer.
    """
    binding = _ModelBinding(make_capture, defer)
    for name, module, layer_id in moe_layers(model):
        binding.bind_layer(name, module, layer_id)
    for name, module in model.named_modules():
        binding.bind_capture_source(name, module)
    if not binding.counts:
        raise UnboundLayerError("No MoE layer found in the model: nothing to capture.")
    return binding.counts


@dataclass
class _ModelBinding:
    """One model's binding as ``bind_model`` walks it."""

    make_capture: Callable[[int, int], LayerCapture]
    defer: Callable[[int, torch.nn.Module], None] | None
    counts: dict[str, int] = field(default_factory=dict)  # layers bound, per backend ("vllm": left to vLLM)
    # The MoE layers of the first step and every module inside them (by identity): theirs, never bound apart.
    owned: set[int] = field(default_factory=set)
    recorded_ids: set[int] = field(default_factory=set)  # layer ids a backend of this plugin records

    def bind_layer(self, name: str, module: torch.nn.Module, layer_id: int) -> None:
        """One MoE layer: the first backend that handles it binds it; else vLLM's binder takes it, or refused."""
        self.owned.update(id(part) for part in module.modules())
        backend = next((key for key, candidate in BACKENDS if candidate.handles(module)), None)
        if backend is None:
            if self._left_to_vllm(module, layer_id):
                return
            raise UnboundLayerError(
                f"MoE layer {name!r}: no capture backend for router {type(module.router).__name__} "
                f"/ quant method {type(quant_method(module)).__name__}; refusing instead of "
                "returning zeros."
            )
        chosen = dict(BACKENDS)[backend]
        counted = getattr(chosen, "zero_experts", None)
        capture = self.make_capture(layer_id, int(counted(module)) if counted is not None else 0)
        chosen.bind(module, capture, name)
        bind_again_after_processing(module, lambda: chosen.bind(module, capture, name))  # weight updates
        self._count(backend)
        self.recorded_ids.add(layer_id)

    def bind_capture_source(self, name: str, module: torch.nn.Module) -> None:
        """A module vLLM's binder binds by its own ``capture_fn`` (``RoutedExpertsCaptureSource``), outside the
        MoE layers and on a layer id no backend here records: left to vLLM, or refused. (vllm-ascend's layers
        and their parts have a capture_fn too: an Ascend backend records them, vllm-ascend's own stays off.)"""
        if id(module) in self.owned or not upstream.is_capture_source(module):
            return
        layer_id = getattr(module, "layer_id")  # noqa: B009
        if not isinstance(layer_id, int):
            raise UnboundLayerError(f"MoE layer {name!r} ({type(module).__name__}) has no layer id ({layer_id!r}).")
        if layer_id in self.recorded_ids:
            return
        if not self._left_to_vllm(module, layer_id):
            raise UnboundLayerError(
                f"MoE layer {name!r} ({type(module).__name__}) records its routing through vLLM's "
                "RoutedExpertsCaptureSource, which only vLLM's binder can bind, and this path hands nothing to it; "
                "refusing instead of returning zeros."
            )

    def _left_to_vllm(self, module: torch.nn.Module, layer_id: int) -> bool:
        if self.defer is None or not upstream.defers(module):
            return False
        self.owned.add(id(module))
        self.defer(layer_id, module)
        self._count("vllm")
        return True

    def _count(self, backend: str) -> None:
        self.counts[backend] = self.counts.get(backend, 0) + 1


def splits_tokens(vllm_config: Any) -> bool:
    """Whether the backend in use splits a step's tokens over the TP ranks before routing (vllm-ascend)."""
    return _vllm_ascend_loaded() and ascend_config.splits_tokens(vllm_config)


def refuse_unsupported_config(vllm_config: Any) -> None:
    """Raise ``UnsupportedVllmError`` for a configuration whose routing no backend can see (vllm-ascend's xlite)."""
    if _vllm_ascend_loaded():
        ascend_config.refuse_unsupported(vllm_config)


def _vllm_ascend_loaded() -> bool:
    """Whether vllm-ascend is imported in this process (its platform plugin loaded): its backends and its
    configuration then apply. Not a platform check: vLLM's ``current_platform`` is never consulted here."""
    return "vllm_ascend" in sys.modules
