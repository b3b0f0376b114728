# SPDX-License-Identifier: Apache-2.0
"""Layers vLLM's own binder binds where no backend of this plugin has a hook: left to vLLM, never lost.

From vLLM 0.28 a module-level ``bind_routed_experts_capturer(model, capturer)`` binds three kinds of layer:
  * ``BaseRouter.set_capture_fn``: the ``router`` backend's seam, which this plugin binds itself;
  * modules that satisfy ``RoutedExpertsCaptureSource`` (a ``layer_id`` and a ``capture_fn`` they call with
    logical ids; 0.33's DeepGEMM MegaMoE experts);
  * monolithic kernels whose experts declare ``supports_routing_replay_capture()`` (FlashInfer TRT-LLM), through
    a ``RoutedExpertsSink`` (0.32+) or ``fused_experts.set_capture_fn`` (0.28-0.31; on 0.27 the runner's own
    binder method does it, ``deferral_binder``).
The last two record ids from inside vLLM's kernels, where the plugin has no hook of its own. It defers them:
vLLM's binder runs on exactly those layers once vLLM hands over its capturer (whose buffer is then the
plugin's), so they are bound as without the plugin, and the always-on check covers their rows too.

``KNOWN_NAMES`` lists every class vLLM's binder refers to that this module knows; ``unknown_seams`` names the
others, so a vLLM that adds a kind of layer is reported (``doctor --surface``) instead of silently losing it.
"""

from __future__ import annotations

import dis
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_ascend_routing import patching
from vllm_ascend_routing.backends._layer import is_vllm_ascend_layer, quant_method
from vllm_ascend_routing.releases import BINDER_FUNCTION, BINDER_METHOD, CAPTURER_MODULE

CAPTURER = CAPTURER_MODULE
BINDER = f"{CAPTURER}:{BINDER_FUNCTION}"
CAPTURE_SOURCE = f"{CAPTURER}:RoutedExpertsCaptureSource"
MONOLITHIC_EXPERTS = "vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEExpertsMonolithic"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

# Classes vLLM's binder may name, and what each is to this plugin. Any other class it names is a new seam.
KNOWN_NAMES = {
    "RoutedExpertsCaptureSource": "deferred to vLLM's binder",
    "FusedMoEExpertsMonolithic": "deferred to vLLM's binder (monolithic experts that support replay capture)",
    "RoutedExpertsSink": "deferred to vLLM's binder (the monolithic kernels' sink)",
    "BaseRouter": "bound by the plugin (router backend)",
    "MoERunner": "the layer vLLM's binder walks (its router or kernel is one of the above)",
    "RoutedExpertsCapturer": "vLLM's capturer, handed the plugin's buffer",
    "FusedMoE": "the layer vLLM's binder walks (its router or kernel is one of the above)",
}


def binder() -> Callable[[Any, Any], None] | None:
    """vLLM's module-level binder (0.28+), or ``None`` where layers are bound by the runner (nothing to defer to)."""
    try:
        found: Callable[[Any, Any], None] = patching.resolve(BINDER)
    except LookupError:
        return None
    return found


def deferral_binder() -> Callable[[Any, Any], None] | None:
    """What binds the layers left to vLLM: its module-level binder (0.28+), or on 0.27, whose runner method
    already binds monolithic kernels, that method as vLLM wrote it (unwrapped from the plugin's hook) on a
    ``_ModelOnlyRunner`` whose model is the deferred layers; ``None`` before (nothing is left to vLLM there).
    Why this is kept as it is: docs/design.md, "Seams kept as they are"."""
    found = binder()
    if found is not None:
        return found
    original = patching.original_of(getattr(_resolved(RUNNER), BINDER_METHOD, None))
    if original is None or not _binds_monolithic_kernels(original):
        return None
    return lambda model, capturer: original(_ModelOnlyRunner(model), capturer)


def _binds_monolithic_kernels(runner_method: Callable[..., Any]) -> bool:
    """Whether vLLM's runner method binds monolithic kernels' experts (0.27), not routers only (0.20-0.26):
    it names ``FusedMoEExpertsMonolithic``, which only that binding needs."""
    return "FusedMoEExpertsMonolithic" in referenced_classes(runner_method)


class _ModelOnlyRunner:
    """The ``self`` vLLM 0.27's runner binder method is called with: it reads ``self.model`` only (its
    ``modules()``); any other attribute raises, never a default."""

    __slots__ = ("model",)

    def __init__(self, model: Any) -> None:
        self.model = model


def _resolved(target: str) -> Any:
    try:
        return patching.resolve(target)
    except LookupError:
        return None


def is_capture_source(module: torch.nn.Module) -> bool:
    """A module vLLM binds by setting its ``capture_fn`` (``RoutedExpertsCaptureSource``), where it has a binder."""
    protocol = _resolved(CAPTURE_SOURCE)  # 0.28+, with the module-level binder
    if protocol is None or binder() is None or is_vllm_ascend_layer(module):
        return False  # vllm-ascend's layers have a capture_fn too: an Ascend backend's, or refused, never vLLM's
    return isinstance(module, protocol)


def monolithic_experts(module: torch.nn.Module) -> Any:
    """The fused experts of a layer whose quant method is monolithic, or ``None``."""
    qm = quant_method(module)
    if qm is None or not getattr(qm, "is_monolithic", False):
        return None
    return getattr(getattr(getattr(qm, "moe_kernel", None), "impl", None), "fused_experts", None)


def captures_monolithic(module: torch.nn.Module) -> bool:
    """A monolithic kernel vLLM's binder binds: experts that declare replay capture, where it has a binder."""
    experts = monolithic_experts(module)
    monolithic = _resolved(MONOLITHIC_EXPERTS)
    if experts is None or monolithic is None or is_vllm_ascend_layer(module) or deferral_binder() is None:
        return False
    supports = getattr(experts, "supports_routing_replay_capture", None)
    return isinstance(experts, monolithic) and callable(supports) and bool(supports())


def defers(module: torch.nn.Module) -> bool:
    """Whether this layer is left to vLLM's binder (no backend of the plugin handles it, vLLM's binds it)."""
    return is_capture_source(module) or captures_monolithic(module)


class _Layers:
    """The one method vLLM's binder calls on a model, over the deferred layers only."""

    def __init__(self, layers: Iterable[torch.nn.Module]) -> None:
        self._layers = tuple(layers)

    def modules(self) -> Iterable[torch.nn.Module]:
        return iter(self._layers)


def bind(layers: Iterable[torch.nn.Module], capturer: Any) -> None:
    """Run vLLM's own binder on the deferred ``layers`` with vLLM's ``capturer`` (its buffer already the plugin's)."""
    deferred = tuple(layers)
    if not deferred:
        return
    bind_upstream = deferral_binder()
    if bind_upstream is None:  # bind_model defers only where the binder exists
        raise RuntimeError("vllm-ascend-routing: layers were left to vLLM's binder, but this vLLM has none")
    bind_upstream(_Layers(deferred), capturer)


@dataclass(frozen=True)
class Seam:
    """One kind of layer vLLM's binder binds in the installed release."""

    name: str  # vLLM's class
    handling: str  # what the plugin does with it; "" where unknown


def seams() -> list[Seam]:
    """Every class vLLM's binder refers to, with what the plugin does about it (``handling`` empty: unknown)."""
    found = binder()
    if found is None:
        return []
    return [Seam(name, KNOWN_NAMES.get(name, "")) for name in sorted(referenced_classes(found))]


def unknown_seams() -> list[str]:
    return [seam.name for seam in seams() if not seam.handling]


def referenced_classes(function: Callable[..., Any]) -> set[str]:
    """Names of vLLM's classes a function loads (module globals, and capitalised names it imports inside its
    body), found in its bytecode."""
    code = getattr(function, "__code__", None)
    if code is None:
        return set()
    names = set()
    module_globals = getattr(function, "__globals__", {})
    for instruction in dis.get_instructions(code):
        if instruction.opname == "IMPORT_FROM" and str(instruction.argval)[:1].isupper():
            names.add(str(instruction.argval))
        elif instruction.opname == "LOAD_GLOBAL":
            value = module_globals.get(instruction.argval)
            if isinstance(value, type) and value.__module__.split(".")[0] == "vllm":
                names.add(str(instruction.argval))
    return names
