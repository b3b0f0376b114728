# SPDX-License-Identifier: Apache-2.0
"""Pick the adapter for the installed vLLM API generation, once; nothing else branches on vLLM.

The adapter is the ``ADAPTER`` of the module the release table names for the detected generation.
"""

from __future__ import annotations

import functools
import importlib

from vllm_ascend_routing import releases
from vllm_ascend_routing.compat._detect import detect_generation, vllm_version
from vllm_ascend_routing.compat.base import (
    SUPPORTED_RELEASES,
    CaptureAPI,
    Generation,
    UnsupportedVllmError,
)

__all__ = ["CaptureAPI", "Generation", "UnsupportedVllmError", "get_api", "vllm_version"]


@functools.cache
def get_api() -> CaptureAPI:
    """The adapter for this process's vLLM (raises ``UnsupportedVllmError`` when there is none)."""
    generation = detect_generation()
    span = releases.span_of(generation)
    if span.adapter:
        api: CaptureAPI = importlib.import_module(span.adapter).ADAPTER()
        return api
    raise UnsupportedVllmError(
        f"vLLM {vllm_version()} uses the '{generation.value}' routed-experts API, which this version of "
        f"vllm-ascend-routing does not implement yet. Supported releases: {SUPPORTED_RELEASES}."
    )
