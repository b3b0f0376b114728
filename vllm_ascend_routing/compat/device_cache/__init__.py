# SPDX-License-Identifier: Apache-2.0
"""Generation ``device-cache`` (vLLM 0.21.0): its contract (prompt and generated rows apart, int16) served with the
plugin's own transport (``adapter``).

SCAFFOLDING: delete this folder (and its release-table row) when the lowest supported vLLM is 0.22 or newer."""

from vllm_ascend_routing.compat.device_cache.adapter import DeviceCacheAdapter

__all__ = ["DeviceCacheAdapter"]
