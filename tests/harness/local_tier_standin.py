# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY stand-in for a KV connector the plugin has no carrier for (an offload tier such as vLLM's
``OffloadingConnector``, or a cache service such as LMCache), none of which runs on vLLM's CPU build: vLLM's own
``ExampleConnector`` (shared-storage KV, which runs here) under another name. The plugin then serves it as it
serves every such connector: rows of prompts computed on the instance held in its scheduler
(``carriers.HeldRowsCarrier``), KV computed elsewhere computed here instead. Loaded by vLLM's connector factory
through ``kv_connector_module_path``; never installed by the plugin.

Like vLLM's offload connectors (``OffloadingConnector``, ``SimpleCPUOffloadConnector``) it supports the hybrid
allocator (``SupportsHMA``), so vLLM's scheduler finishes its requests through ``request_finished_all_groups``, as it
does theirs."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class LocalTierStandIn(ExampleConnector, SupportsHMA):
    """ExampleConnector's storage and flow, named as no connector the plugin knows, finished as the offload
    connectors are (one KV cache group here: the tiny models are not hybrid)."""

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        (group,) = block_ids
        # ExampleConnector's own method, as the offload connectors call their scheduler side (not the instance's
        # request_finished, which vLLM never calls for a connector that supports the hybrid allocator)
        return ExampleConnector.request_finished(self, request, group)
