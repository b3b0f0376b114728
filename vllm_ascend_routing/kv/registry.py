# SPDX-License-Identifier: Apache-2.0
"""The connectors whose KV the plugin carries rows with, by the name ``--kv-transfer-config`` gives them; every other
served connector gets ``carriers.HeldRowsCarrier`` (``kv.policy``)."""

from __future__ import annotations

from vllm_ascend_routing.kv.carriers import SharedStorageCarrier, TransferParamsCarrier
from vllm_ascend_routing.kv.named import TransferIdCarrier

# vllm-ascend's Mooncake P/D connectors whose prefill returns the parameters the proxy passes to the decode instance
# (pull mode, as NIXL's): the rows ride in them, or their key with a row store.
ASCEND_PARAMS = (
    "MooncakeConnectorV1",
    "MooncakeConnectorV2",
    "MooncakePullConnector",
    "MooncakeD2RHConnectorV1",
    "MooncakeHybridConnector",
)

CARRIERS: dict[str, type[SharedStorageCarrier] | type[TransferParamsCarrier] | type[TransferIdCarrier]] = {
    SharedStorageCarrier.connector: SharedStorageCarrier,
    TransferParamsCarrier.connector: TransferParamsCarrier,
    "NixlPullConnector": TransferParamsCarrier,  # vLLM's NixlConnector is this class
    **dict.fromkeys(ASCEND_PARAMS, TransferParamsCarrier),
    TransferIdCarrier.connector: TransferIdCarrier,  # rows through the row store, by transfer id
}

# Served only with a row store and a deployment secret (their rows go by name through the store, nowhere else).
NEEDS_STORE = (TransferIdCarrier.connector,)
