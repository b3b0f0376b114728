# SPDX-License-Identifier: Apache-2.0
"""Pick the adapter for the installed vLLM API generation, once; nothing else branches on vLLM."""

from __future__ import annotations

import functools

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
    if generation is Generation.SHM:
        from vllm_ascend_routing.compat.shm import ShmAPI

        return ShmAPI()
    if generation is Generation.RUNNER_OUTPUT:
        from vllm_ascend_routing.compat.runner_output import RunnerOutputAPI

        return RunnerOutputAPI()
    if generation is Generation.AUX_OUTPUT:
        from vllm_ascend_routing.compat.aux_output import AuxOutputAPI

        return AuxOutputAPI()
    raise UnsupportedVllmError(
        f"vLLM {vllm_version()} uses the '{generation.value}' routed-experts API, which this version of "
        f"vllm-ascend-routing does not implement yet. Supported releases: {SUPPORTED_RELEASES}."
    )
