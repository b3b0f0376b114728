# SPDX-License-Identifier: Apache-2.0
"""Which KV connectors routed experts are served with, and the refusal of the others (``docs/disaggregation.md``).

Served: connectors the plugin carries rows with (``registry.CARRIERS``: rows beside the KV they move) and every
other connector that is not a P/D hand-over (offload tiers, cache services: the scheduler holds the rows of KV its
instance computed, ``carriers.HeldRowsCarrier``). Refused by name: connectors that hand KV between instances in a way
the plugin carries no rows through (``REFUSED``), at model load in every worker (``refuse_uncovered``) and wherever
vLLM's own refusal is lifted for the served ones (``lifts``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm_ascend_routing import envs, patching
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.kv import carriers, registry

if TYPE_CHECKING:
    from vllm_ascend_routing.kv.stores import KvRows
    from vllm_ascend_routing.patching import Patch

DOCS = "docs/disaggregation.md"

# Connectors that hand KV from one instance to another (P/D disaggregation), by the name in --kv-transfer-config:
# refused, for the reason given. Served instead: NIXL's pull mode (``NixlConnector``) and vllm-ascend's Mooncake P/D
# connectors that return parameters alike (rows, or their key, in the kv_transfer_params:
# ``carriers.TransferParamsCarrier``), and vLLM's ``MooncakeConnector`` with a row store (rows by transfer id:
# ``named.TransferIdCarrier``). vLLM 0.31+ itself refuses Nixl, MoRIIO and Mooncake; the plugin lifts that for the
# served ones. vllm-ascend's ``kv_pool`` connectors are stores and offload tiers: served.
_PUSHED = (
    "it pushes KV into the decode instance while the prefill runs and returns no parameters, so nothing the prefill "
    "instance computed can go with it"
)
REFUSED: dict[str, str] = {
    "NixlPushConnector": (
        "in NIXL's push mode the decode request may be sent at the same time as the prefill request, with parameters "
        "written before the prefill computed any row, so no rows can ride in them; use NixlConnector (pull mode, "
        "vLLM's default: served, rows in the parameters the prefill instance returns)"
    ),
    **dict.fromkeys(
        ("MoRIIOConnector", "P2pNcclConnector"),
        "it moves KV between instances over RDMA/NCCL without parameters or a shared identifier the plugin could carry "
        "rows by; use NixlConnector or MooncakeConnector (served)",
    ),
    "MooncakeLayerwiseConnector": f"(vllm-ascend) {_PUSHED}; use MooncakeConnectorV1 (served)",
    "SfaRemoteD2HConnector": f"(vllm-ascend) {_PUSHED}; use MooncakeConnectorV1 (served)",
}  # fmt: skip
_NEEDS_STORE = (
    "its rows go through the row store only (its proxy passes the decode instance a transfer id, nothing the prefill "
    "instance returns): set VLLM_ASCEND_ROUTING_STORE (shm on one host, mooncake://... across hosts) and the same "
    "VLLM_ASCEND_ROUTING_KV_SECRET on the prefill and decode instances"
)
# Inside MultiConnector, a connector whose rows ride in kv_transfer_params is refused: the plugin follows
# MultiConnector, which merges its connectors' parameters, so no rows would ride in that connector's parameters and
# every load of KV another instance lent through it would be declined (computed here).
_INSIDE_MULTI = (
    "inside MultiConnector its rows do not ride in its kv_transfer_params (the plugin follows MultiConnector, and "
    "every load that connector offers would be computed here instead); configure it alone"
)


def connector_name(kv_transfer_config: Any) -> str | None:
    """The connector ``kv_transfer_config`` configures, or ``None`` (no KV transfer)."""
    if kv_transfer_config is None or getattr(kv_transfer_config, "kv_connector", None) is None:
        return None
    return str(kv_transfer_config.kv_connector)


def _named(kv_transfer_config: Any) -> list[str]:
    """The connector's name, then those ``MultiConnector`` combines (``kv_connector_extra_config["connectors"]``)."""
    name = connector_name(kv_transfer_config)
    if name is None:
        return []
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    inner = extra.get("connectors", []) if name == "MultiConnector" and isinstance(extra, dict) else []
    return [name, *(str(c.get("kv_connector")) for c in inner if isinstance(c, dict))]


def _refused(kv_transfer_config: Any) -> tuple[str, str] | None:
    """The first configured connector routed experts are refused with, and why (``None``: all served)."""
    for position, name in enumerate(_named(kv_transfer_config)):
        if name in REFUSED:
            return name, REFUSED[name]
        if position > 0 and name in registry.CARRIERS and name != carriers.SharedStorageCarrier.connector:
            return name, _INSIDE_MULTI
        if name in registry.NEEDS_STORE and not (
            envs.VLLM_ASCEND_ROUTING_STORE.strip() and envs.VLLM_ASCEND_ROUTING_KV_SECRET
        ):
            return name, _NEEDS_STORE
    return None


def serves(kv_transfer_config: Any) -> bool:
    """Whether routed experts are served with the configured connector (rows carried with its KV, or held here
    for the KV this instance computed); not for a connector that hands KV over between instances in a way the
    plugin carries no rows through (``REFUSED``)."""
    return bool(_named(kv_transfer_config)) and _refused(kv_transfer_config) is None


def lifts(kv_transfer_config: Any, name: str) -> bool:
    """Whether vLLM's own refusal of routed experts with connector ``name`` is lifted: the configured connectors are
    served and ``name`` is one the plugin carries rows for (vLLM 0.31+ refuses NIXL; 0.22-0.30 refuse every one)."""
    return name in _named(kv_transfer_config) and serves(kv_transfer_config) and name in registry.CARRIERS


def holds_rows(kv_transfer_config: Any) -> bool:
    """Whether the scheduler holds the rows itself (``carriers.HeldRowsCarrier``): no carrier writes into this
    connector's storage."""
    return serves(kv_transfer_config) and connector_name(kv_transfer_config) not in registry.CARRIERS


def refusal(kv_transfer_config: Any, generation: str, carried_here: bool = True) -> str:
    """Why routed experts are refused with this connector, and what to do instead."""
    name = connector_name(kv_transfer_config)
    role = getattr(kv_transfer_config, "kv_role", None)
    if not carried_here:
        return (
            f"vllm-ascend-routing: KV connector {name} ({role}) with routed experts is served from vLLM 0.22 on; "
            f"vLLM's '{generation}' design has no store the rows of loaded tokens could be put in, so they would "
            "come back as zeros or another request's rows. Use vLLM 0.22 or newer, or remove --kv-transfer-config "
            "(and --kv-offloading-size), or unset VLLM_ASCEND_ROUTING; see " + DOCS + "."
        )
    refused, why = _refused(kv_transfer_config) or (str(name), "not served")
    inside = "" if refused == name else f" (inside {name})"
    return (
        f"vllm-ascend-routing: KV connector {refused}{inside} ({role}) is not covered: {why}. Tokens whose KV it "
        "loads were never computed on this instance, and their routed-experts rows would come back as zeros or as "
        "another request's rows. Served: NixlConnector and vllm-ascend's MooncakeConnectorV1/V2, "
        "MooncakePullConnector, MooncakeD2RHConnectorV1 and MooncakeHybridConnector (rows in their "
        "kv_transfer_params), MooncakeConnector with a row store, ExampleConnector (rows beside its KV) and every "
        "connector that is not a P/D hand-over (offload tiers, cache services: rows of KV "
        "this instance computed held in its memory, other KV computed here instead). Use such a connector, or remove "
        "--kv-transfer-config for routed-experts rollouts, or unset VLLM_ASCEND_ROUTING (vLLM then refuses routed "
        f"experts with this connector itself); see {DOCS}."
    )


def refuse_uncovered(vllm_config: Any, generation: str, kv_rows: KvRows | None, relied: tuple[Patch, ...] = ()) -> None:
    """At model load (every worker): refuse a KV connector whose loaded tokens' rows the plugin cannot serve,
    naming it; vLLM's own check is lifted only for the served ones (``serves``). ``kv_rows``: the generation's store
    of loaded rows (``None``: it has none); ``relied``: what the follower and the carriers rely on besides it."""
    config = getattr(vllm_config, "kv_transfer_config", None)
    if connector_name(config) is None:
        return
    if kv_rows is None or not serves(config):
        raise UnsupportedVllmError(refusal(config, generation, carried_here=kv_rows is not None))
    # The rows for KV connectors are optional in the manifest (an engine without one never needs them): required now.
    needed = (*relied, *kv_rows.patches)
    missing = [p.target for p in needed if patching.problem(dataclasses.replace(p, required=True))]
    if missing:
        raise UnsupportedVllmError(
            f"vllm-ascend-routing: KV connector {connector_name(config)} is served, but this vLLM lacks what the "
            f"plugin carries its rows with: {', '.join(missing)}. Remove --kv-transfer-config or unset "
            "VLLM_ASCEND_ROUTING."
        )
