# SPDX-License-Identifier: Apache-2.0
"""vLLM's API generations, one folder each (``shm/``, ``device_cache/``, ``runner_output/``, ``aux_output/``: its
adapter, and where it has them its KV row store and request hooks), behind one interface (``interface.Adapter``).

Detection (``_detect``: the release table's markers, the version as tie-break) picks one, once per process;
``adapter()`` returns its adapter. Nothing outside this package asks which vLLM is installed: features ask the
adapter for a capability. Deleting a generation is deleting its folder and its release-table row.
"""

from __future__ import annotations

import functools
import importlib

from vllm_ascend_routing import releases
from vllm_ascend_routing.compat._detect import SUPPORTED_RELEASES, detect_generation, vllm_version
from vllm_ascend_routing.compat.interface import Adapter
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.releases import Generation

__all__ = [
    "Adapter",
    "Generation",
    "UnsupportedVllmError",
    "adapter",
    "adapter_class",
    "adapter_classes",
    "vllm_version",
]


def adapter_class(generation: Generation) -> type[Adapter] | None:
    """The adapter class the release table names for ``generation`` (``None``: the generation is refused)."""
    span = releases.span_of(generation)
    if not span.adapter:
        return None
    module_name, _, name = span.adapter.partition(":")
    found: type[Adapter] = getattr(importlib.import_module(module_name), name)
    return found


def adapter_classes() -> tuple[type[Adapter], ...]:
    """Every implemented generation's adapter class, oldest first."""
    return tuple(filter(None, (adapter_class(span.generation) for span in releases.implemented())))


@functools.cache
def adapter() -> Adapter:
    """The adapter for this process's vLLM (raises ``UnsupportedVllmError`` when there is none)."""
    generation = detect_generation()
    cls = adapter_class(generation)
    if cls is None:
        raise UnsupportedVllmError(
            f"vLLM {vllm_version()} uses the '{generation.value}' routed-experts API, which this version of "
            f"vllm-ascend-routing does not implement yet. Supported releases: {SUPPORTED_RELEASES}."
        )
    return cls()
