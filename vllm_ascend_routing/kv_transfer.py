# SPDX-License-Identifier: Apache-2.0
"""Routing rows of tokens whose KV a connector loaded (P/D disaggregation, prefix reuse across instances):
carried with that KV, or those tokens computed here. Never zeros, never another request's rows.

vLLM keeps one routing row per KV slot (0.22-0.30) or per computed block (0.31+). A token whose KV came through
a connector was never computed on this instance: its slot holds zeros, or the rows of whichever request used the
slot before. This module follows vLLM's own KV-connector calls in the scheduler, for connectors whose KV the plugin
carries rows with (``kv_carrier.CARRIERS``), holds rows for (any other served connector), or refuses by name:

  * ``get_num_new_matched_tokens``: the connector offers the KV of prompt tokens ``[a, b)``; their rows are read
    from beside that KV and checked by validation mode's rules. Rows that are absent (the KV was stored by an
    instance without the plugin, or removed) or fail the check: the offer is declined, so vLLM computes those
    tokens here (exact rows, at the cost of their prefill), and the request and tokens are reported;
  * ``update_state_after_alloc``: the tokens vLLM will load get their carried rows in this generation's store
    (``SchedulerRows.inject``: the slot buffer, or the AuxOutput block store), before any read of them;
  * ``request_finished`` (or ``request_finished_all_groups``, which the scheduler calls instead for a connector
    that supports the hybrid allocator): the rows of a finished request (its prompt's; the held carrier also keeps
    its generated tokens' where the generation's store has them) go with the KV its connector stored or lent
    (``Carrier.put``, given what the connector returned: NIXL's parameters carry them), whatever the role (a
    ``kv_both`` instance stores and loads);
  * ``Scheduler.reset_prefix_cache`` (held rows only): everything held is dropped first.

``loaded_rows(request)`` / ``loaded_span(request)`` tell, per request, how many rows (from which token) were
loaded through the connector; ``stats()`` counts loads, declined offers and stored rows in this process.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from vllm_ascend_routing import envs, kv_carrier, patching, validate
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.compat.base import UnsupportedVllmError
from vllm_ascend_routing.kv_carrier import Missing, RowLayout
from vllm_ascend_routing.patching import RELY, Patch
from vllm_ascend_routing.releases import Generation

logger = get_logger(__name__)

_LOADED = "_vllm_ascend_routing_loaded"  # Request attribute: (first token, count) of the rows loaded
_HELD = "_vllm_ascend_routing_held_rows"  # Scheduler attribute: its kv_carrier.HeldRowsCarrier
DOCS = "docs/disaggregation.md"

# Connectors that hand KV from one instance to another (P/D disaggregation), by the name in --kv-transfer-config:
# refused. Declining their load is their own path for a full local hit (the sender is told to free its blocks), which
# no machine of this project can run for these; vLLM 0.31+ itself refuses Nixl, MoRIIO and Mooncake. NIXL's pull mode
# (``NixlConnector``) is served: its rows ride in the kv_transfer_params (``kv_carrier.TransferParamsCarrier``).
# vllm-ascend's are those it registers from its ``kv_p2p`` package (its ``kv_pool`` ones are stores and offload
# tiers: served).
REFUSED: dict[str, str] = {
    "NixlPushConnector": (
        "in NIXL's push mode the decode request may be sent at the same time as the prefill request, with parameters "
        "written before the prefill computed any row, so no rows can ride in them; use NixlConnector (pull mode, "
        "vLLM's default: served, rows in the parameters the prefill instance returns)"
    ),
    **dict.fromkeys(
        ("MooncakeConnector", "MoRIIOConnector", "P2pNcclConnector"),
        "it moves KV between instances over RDMA/NCCL, which the plugin does not carry rows through yet (it cannot "
        "be run on this project's machines)",
    ),
    **dict.fromkeys(
        (
            "MooncakeConnectorV1",
            "MooncakeConnectorV2",
            "MooncakePullConnector",
            "MooncakeD2RHConnectorV1",
            "MooncakeHybridConnector",
            "MooncakeLayerwiseConnector",
            "SfaRemoteD2HConnector",
        ),
        "vllm-ascend moves KV between instances with it (P/D over HCCS/RDMA), which the plugin does not carry rows "
        "through yet (it cannot be run on this project's machines)",
    ),
}  # fmt: skip
# Inside MultiConnector, a connector whose rows ride in kv_transfer_params is refused: the plugin follows
# MultiConnector, which merges its connectors' parameters, so no rows would ride in that connector's parameters and
# every load of KV another instance lent through it would be declined (computed here).
_INSIDE_MULTI = (
    "inside MultiConnector its rows do not ride in its kv_transfer_params (the plugin follows MultiConnector, and "
    "every load that connector offers would be computed here instead); configure it alone"
)


def scheduler_init_patch(generations: tuple[Generation, ...], remove: str) -> Patch:
    """vLLM's ``Scheduler.__init__``, wrapped by :func:`attaching`; ``vllm_config`` is relied on: each generation's
    row store reads the scheduler's config after it."""
    return Patch(
        "vllm.v1.core.sched.scheduler:Scheduler.__init__",
        "with a KV connector and routed experts on: rows follow the connector's loads and saves (kv_transfer)",
        remove,
        generations,
        ("self", "vllm_config"),
    )


def connector_patches(generations: tuple[Generation, ...]) -> tuple[Patch, ...]:
    """The connector API the scheduler hooks follow (wrapped per connector instance, not replaced). The scheduler's
    ``reset_prefix_cache``, after which rows held here are dropped, is in the manifest already (``output.engine``)."""
    why = "followed per connector instance: which tokens are loaded, and when a request's KV is stored"
    # Optional in the manifest: needed once a connector is configured (``refuse_uncovered`` checks them then).
    base = "vllm.distributed.kv_transfer.kv_connector.v1.base"
    return tuple(
        Patch(f"{base}:{n}", why, "never while KV connectors are served", generations, params, required=False,
              action=RELY)
        for n, params in (
            ("KVConnectorBase_V1.get_num_new_matched_tokens", ("self", "request", "num_computed_tokens")),
            ("KVConnectorBase_V1.update_state_after_alloc", ("self", "request", "blocks", "num_external_tokens")),
            ("KVConnectorBase_V1.request_finished", ("self", "request", "block_ids")),
            # what the scheduler calls instead for a connector that supports the hybrid allocator (SupportsHMA:
            # NIXL, the offload connectors, MultiConnector): block ids per KV cache group
            ("SupportsHMA.request_finished_all_groups", ("self", "request", "block_ids")),
        )
    )  # fmt: skip


# ---- which connectors are served ----


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
        if position > 0 and kv_carrier.CARRIERS.get(name) is kv_carrier.TransferParamsCarrier:
            return name, _INSIDE_MULTI
    return None


def serves(kv_transfer_config: Any) -> bool:
    """Whether routed experts are served with the configured connector (rows carried with its KV, or held here
    for the KV this instance computed); not for a connector that hands KV over between instances in a way the
    plugin carries no rows through (``REFUSED``)."""
    return bool(_named(kv_transfer_config)) and _refused(kv_transfer_config) is None


def lifts(kv_transfer_config: Any, name: str) -> bool:
    """Whether vLLM's own refusal of routed experts with connector ``name`` is lifted: the configured connectors are
    served and ``name`` is one the plugin carries rows for (vLLM 0.31+ refuses NIXL; 0.22-0.30 refuse every one)."""
    return name in _named(kv_transfer_config) and serves(kv_transfer_config) and name in kv_carrier.CARRIERS


def holds_rows(kv_transfer_config: Any) -> bool:
    """Whether the scheduler holds the rows itself (``kv_carrier.HeldRowsCarrier``): no carrier writes into this
    connector's storage."""
    return serves(kv_transfer_config) and connector_name(kv_transfer_config) not in kv_carrier.CARRIERS


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
        "another request's rows. Served: NixlConnector (rows in its kv_transfer_params), ExampleConnector (rows "
        "beside its KV) and every connector that is not a P/D hand-over (offload tiers, cache services: rows of KV "
        "this instance computed held in its memory, other KV computed here instead). Use such a connector, or remove "
        "--kv-transfer-config for routed-experts rollouts, or unset VLLM_ASCEND_ROUTING (vLLM then refuses routed "
        f"experts with this connector itself); see {DOCS}."
    )


def refuse_uncovered(vllm_config: Any, generation: str) -> None:
    """At model load (every worker): refuse a KV connector whose loaded tokens' rows the plugin cannot serve,
    naming it; vLLM's own check is lifted only for the served ones (``serves``)."""
    config = getattr(vllm_config, "kv_transfer_config", None)
    if connector_name(config) is None:
        return
    from vllm_ascend_routing.compat import get_api

    kv_rows = getattr(get_api(), "kv_rows", None)
    if kv_rows is None or not serves(config):
        raise UnsupportedVllmError(refusal(config, generation, carried_here=kv_rows is not None))
    # The rows for KV connectors are optional in the manifest (an engine without one never needs them): required now.
    missing = [p.target for p in kv_rows.patches if patching.problem(dataclasses.replace(p, required=True))]
    if missing:
        raise UnsupportedVllmError(
            f"vllm-ascend-routing: KV connector {connector_name(config)} is served, but this vLLM lacks what the "
            f"plugin carries its rows with: {', '.join(missing)}. Remove --kv-transfer-config or unset "
            "VLLM_ASCEND_ROUTING."
        )


# ---- what a generation provides ----


class SchedulerRows(Protocol):
    """One scheduler's routed-experts store, as this generation keeps it."""

    layout: RowLayout

    def finished_rows(self, request: Any, block_ids: Any) -> np.ndarray | None:
        """The rows of a finished request's tokens from token 0 on, ``[n, L, K]``: its prompt, then (where the
        store keeps them) its generated tokens but the last (``None``: unknown)."""

    def inject(self, request: Any, blocks: Any, start: int, rows: np.ndarray) -> None:
        """Make ``rows`` the rows of the request's tokens ``[start, start + len(rows))``, which vLLM loads."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop what is kept for it."""


class KvRows(Protocol):
    """What a generation module provides so that rows follow KV connectors (``ADAPTER.kv_rows``)."""

    patches: tuple[Patch, ...]  # everything it and the carriers rely on (checked when a connector is configured)

    def install(self) -> None:
        """Process-wide patches (the scheduler hook, vLLM's config check, worker-side stores)."""

    def attach(self, scheduler: Any) -> SchedulerRows | None:
        """This scheduler's store, or ``None`` where it returns no routed experts."""


def install(api: Any) -> None:
    """Install the generation's ``kv_rows`` (nothing where it has none: KV connectors are refused there)."""
    kv_rows: KvRows | None = getattr(api, "kv_rows", None)
    if kv_rows is not None:
        kv_rows.install()


def attaching(init: Callable[..., None], kv_rows: KvRows) -> Callable[..., None]:
    """vLLM's ``Scheduler.__init__``, then (a KV connector and routed experts on) rows follow the connector."""

    @functools.wraps(init)
    def scheduler_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        connector = getattr(self, "connector", None)
        rows = kv_rows.attach(self) if connector is not None else None
        if rows is not None:
            _follow(self, connector, rows)

    return scheduler_init


# ---- per request ----


def loaded_span(request: Any) -> tuple[int, int] | None:
    """``(first token, count)`` of the request's tokens whose KV (and rows) were loaded through the KV connector,
    or ``None``. Rows of those tokens were computed on the instance that stored the KV; the others here."""
    span = getattr(request, _LOADED, None)
    return None if span is None else (int(span[0]), int(span[1]))


def held_rows(scheduler: Any) -> kv_carrier.HeldRowsCarrier | None:
    """The rows a scheduler holds for its connector (``None``: its connector has a carrier of its own, or none)."""
    held: kv_carrier.HeldRowsCarrier | None = getattr(scheduler, _HELD, None)
    return held


def loaded_rows(request: Any) -> int:
    """How many of the request's rows were loaded through the KV connector (0: all computed here)."""
    span = loaded_span(request)
    return 0 if span is None else span[1]


@dataclass
class KvRowsStats:
    """This process's counts (every scheduler together)."""

    requests_loaded: int = 0
    rows_loaded: int = 0
    offers_declined: int = 0  # loads declined for want of exact rows: those tokens were computed here
    rows_declined: int = 0
    rows_stored: int = 0  # rows written beside KV a connector stored

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


_STATS = KvRowsStats()
_LOCK = threading.Lock()
_REPORTS: list[str] = []  # the first few reports of this process (tests, doctor)


def stats() -> KvRowsStats:
    with _LOCK:
        return KvRowsStats(**_STATS.as_dict())


def first_reports() -> list[str]:
    with _LOCK:
        return list(_REPORTS)


def _count(**increments: int) -> None:
    with _LOCK:
        for name, value in increments.items():
            setattr(_STATS, name, getattr(_STATS, name) + value)


class _Follower:
    """The rows that follow one scheduler's connector."""

    def __init__(self, connector: Any, rows: SchedulerRows, carrier: kv_carrier.Carrier, model: Any) -> None:
        self.connector = connector
        self.rows = rows
        self.carrier = carrier
        self.model = model
        self.strict = envs.VLLM_ASCEND_ROUTING_VALIDATE == "strict"
        self.offered: dict[str, tuple[int, np.ndarray]] = {}  # request -> (first token, carried rows)
        self.reports = 0

    def matched(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any) -> Any:
            count, load_async = original(request, num_computed_tokens, *args, **kwargs)
            self.offered.pop(request.request_id, None)
            if not count or count <= 0:
                return count, load_async
            start = int(num_computed_tokens)  # vLLM loads from the local hit it passed on
            carried = self.carrier.get(request, start, int(count))
            if not isinstance(carried, Missing):
                carried = self._checked(carried, request.request_id, start, "carried with that KV")
            if isinstance(carried, Missing):
                self._decline(request.request_id, start, int(count), carried.reason)
                return 0, False
            self.offered[request.request_id] = (start, carried)
            return count, load_async

        return get_num_new_matched_tokens

    def allocated(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int, *args: Any, **kw: Any) -> Any:
            result = original(request, blocks, num_external_tokens, *args, **kw)
            offered = self.offered.pop(request.request_id, None)
            if num_external_tokens > 0:
                if offered is None or len(offered[1]) < num_external_tokens:
                    raise RuntimeError(
                        f"vllm-ascend-routing: request {request.request_id} loads {num_external_tokens} tokens "
                        f"through {self.carrier.connector} without the rows carried for them; refusing to return "
                        "rows its slots never held."
                    )
                start, carried = offered
                self.rows.inject(request, blocks, start, carried[:num_external_tokens])
                setattr(request, _LOADED, (start, int(num_external_tokens)))
                _count(requests_loaded=1, rows_loaded=int(num_external_tokens))
            return result

        return update_state_after_alloc

    def finished(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def request_finished(request: Any, block_ids: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                rows = self._finished_rows(request, block_ids)
            finally:
                self.offered.pop(request.request_id, None)
                self.rows.forget(request.request_id)
            finished = original(request, block_ids, *args, **kwargs)
            if rows is not None:  # after the connector: a carrier may put them into what it returned
                _count(rows_stored=self.carrier.put(request, rows, finished))
            return finished

        return request_finished

    def _finished_rows(self, request: Any, block_ids: Any) -> np.ndarray | None:
        """The finished request's rows, checked (``None``: none to store)."""
        # Only once the prompt was computed and its output processed: every prompt row is in the store then.
        if int(getattr(request, "num_output_tokens", 0) or 0) <= 0:
            return None
        rows = self.rows.finished_rows(request, block_ids)
        if rows is None:
            return None
        checked = self._checked(rows, request.request_id, 0, "computed for it")
        return None if isinstance(checked, Missing) else checked

    def _checked(self, rows: np.ndarray, request_id: str, start: int, what: str) -> np.ndarray | Missing:
        """Validation mode's rules on rows that travel with KV (ids in range, distinct, dense layers zero: an
        all-zero or stale-looking row is refused, never passed on)."""
        if not self.rows.layout.matches(rows):
            return Missing(f"rows {rows.shape} {rows.dtype}, this engine's layout is {self.rows.layout}")
        found = validate.check(rows, request_id=request_id, expected_rows=len(rows), model=self.model)
        if not found:
            return rows
        text = (
            f"vllm-ascend-routing: request {request_id}: routing rows {what} (tokens from {start}) break the "
            f"contract: {'; '.join(map(str, found))}"
        )
        self._report(text, error=True)
        if self.strict:
            raise validate.RoutingValidationError(text)
        return Missing("those rows break the contract (reported above)")

    def _decline(self, request_id: str, start: int, count: int, reason: str) -> None:
        _count(offers_declined=1, rows_declined=count)
        self._report(
            f"vllm-ascend-routing: request {request_id}: {self.carrier.connector} offers the KV of tokens "
            f"[{start}, {start + count}) but {reason}. Those tokens are computed here instead of loaded (their "
            "routed experts are exact; the load is skipped).",
            error=False,
        )

    def _report(self, text: str, error: bool) -> None:
        self.reports += 1
        with _LOCK:
            if len(_REPORTS) < 5:
                _REPORTS.append(text)
        if self.reports & (self.reports - 1) == 0:  # the 1st, 2nd, 4th ...: loud, no flood
            (logger.error if error else logger.warning)("%s (report %d; %s)", text, self.reports, stats().as_dict())


def _follow(scheduler: Any, connector: Any, rows: SchedulerRows) -> None:
    config = scheduler.vllm_config.kv_transfer_config
    if not serves(config):  # refused at model load already; a scheduler built another way stops here
        raise UnsupportedVllmError(refusal(config, "this"))
    name = type(connector).__name__
    carrier: kv_carrier.Carrier
    if not holds_rows(config):
        carrier = kv_carrier.CARRIERS[str(connector_name(config))](connector, rows.layout)
        where = f"carried with its KV ({rows.layout} per token)"
    else:
        capacity = envs.VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB << 20
        held = kv_carrier.HeldRowsCarrier(name, rows.layout, scheduler.vllm_config.cache_config.block_size, capacity)
        # around: the scheduler class's reset_prefix_cache is another patch's replacement (output.engine)
        patching.wrap(scheduler, "reset_prefix_cache", functools.partial(_dropping_held_rows, held=held), around=True)
        setattr(scheduler, _HELD, held)
        carrier = held
        where = (
            f"of KV this instance computed held here (up to {capacity >> 20} MiB, "
            "VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB); KV computed elsewhere is computed here instead"
        )
    model = validate.ModelRouting.from_vllm_config(scheduler.vllm_config)
    follower = _Follower(connector, rows, carrier, model)
    patching.wrap(connector, "get_num_new_matched_tokens", follower.matched)
    patching.wrap(connector, "update_state_after_alloc", follower.allocated)
    patching.wrap(connector, "request_finished", follower.finished)
    if hasattr(connector, "request_finished_all_groups"):  # SupportsHMA: vLLM's scheduler calls this one instead
        patching.wrap(connector, "request_finished_all_groups", follower.finished)
    logger.info("routed experts follow KV connector %s: rows of loaded tokens %s", name, where)


def _dropping_held_rows(original: Callable[..., Any], held: kv_carrier.HeldRowsCarrier) -> Callable[..., Any]:
    def reset_prefix_cache(*args: Any, **kwargs: Any) -> Any:
        held.clear()  # before the reset: a load after it must not find rows of the weights before it
        return original(*args, **kwargs)

    return reset_prefix_cache
