# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY stand-in for a KV connector the plugin has no carrier for (an offload tier such as vLLM's
``OffloadingConnector``, or a cache service such as LMCache), none of which runs on vLLM's CPU build: vLLM's own
``ExampleConnector`` (shared-storage KV, which runs here) under another name. The plugin then serves it as it
serves every such connector: rows of prompts computed on the instance held in its scheduler
(``kv_carrier.HeldRowsCarrier``), KV computed elsewhere computed here instead. Loaded by vLLM's connector factory
through ``kv_connector_module_path``; never installed by the plugin."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class LocalTierStandIn(ExampleConnector):
    """ExampleConnector's storage and flow, named as no connector the plugin knows."""
