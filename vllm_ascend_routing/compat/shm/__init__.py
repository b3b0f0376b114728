# SPDX-License-Identifier: Apache-2.0
"""Generation ``shm`` (vLLM 0.20.x): process-wide singletons and a KV-slot-indexed shared-memory store.
``adapter``: the adapter and its substitutes for vLLM's capturer and reader; ``store``: the segments.

SCAFFOLDING: delete this folder (and its release-table row) when the lowest supported vLLM is 0.22 or newer."""

from vllm_ascend_routing.compat.shm.adapter import ShmAdapter

__all__ = ["ShmAdapter"]
