# SPDX-License-Identifier: Apache-2.0
"""Following vLLM's own KV-connector calls in the scheduler, so that rows travel with the KV a connector moves.

For connectors the plugin serves (``kv.policy``), one ``Follower`` per scheduler wraps its connector instance:

  * ``get_num_new_matched_tokens``: the connector offers the KV of prompt tokens ``[a, b)``; their rows are read
    from beside that KV (the connector's ``Carrier``) and checked by validation mode's rules. Rows that are absent
    (the KV was stored by an instance without the plugin, or removed) or fail the check: the offer is declined, so
    vLLM computes those tokens here (exact rows, at the cost of their prefill), and the request and tokens are
    reported;
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

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_ascend_routing import envs, patching, validate
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.kv import carriers, registry, shared
from vllm_ascend_routing.kv.carriers import Missing, Pending
from vllm_ascend_routing.kv.policy import connector_name, holds_rows, refusal, serves
from vllm_ascend_routing.kv.stores import KvRows, SchedulerRows
from vllm_ascend_routing.patching import RELY, Patch
from vllm_ascend_routing.reporting import ProcessReports, loud

logger = get_logger(__name__)

_LOADED = "_vllm_ascend_routing_loaded"  # Request attribute: (first token, count) of the rows loaded
_HELD = "_vllm_ascend_routing_held_rows"  # Scheduler attribute: its carriers.HeldRowsCarrier
_KEEP = "never while KV connectors are served"
SCHEDULER_INIT = Patch(
    "vllm.v1.core.sched.scheduler:Scheduler.__init__",
    "with a KV connector and routed experts on: rows follow the connector's loads and saves (kv.follower)",
    _KEEP,
    params=("self", "vllm_config"),
)


# A request waiting for rows still to come asks the store at most this often (seconds): vLLM asks again at every
# step, and a Mooncake store answers each look-up over the network.
POLL_S = 0.02

# A declined load of a connector whose hand-over must run to its end (``discards_declined``): the KV is received and
# then discarded through vLLM's own path for a failed load (recomputed from the local hit).
DISCARD_SITE = Patch(
    "vllm.v1.core.sched.scheduler:Scheduler._update_waiting_for_remote_kv",
    "a declined MooncakeConnector load: its received KV is discarded as vLLM discards a failed load (recomputed)",
    _KEEP,
    params=("self", "request"),
    required=False,
    action=RELY,
)


def connector_patches() -> tuple[Patch, ...]:
    """The connector API the follower wraps (per connector instance, not replaced). The scheduler's
    ``reset_prefix_cache``, after which rows held here are dropped, is in the manifest already (``output.engine``)."""
    why = "followed per connector instance: which tokens are loaded, and when a request's KV is stored"
    # Optional in the manifest: needed once a connector is configured (``policy.refuse_uncovered`` checks them then).
    base = "vllm.distributed.kv_transfer.kv_connector.v1.base"
    return tuple(
        Patch(f"{base}:{n}", why, _KEEP, params=params, required=False, action=RELY)
        for n, params in (
            ("KVConnectorBase_V1.get_num_new_matched_tokens", ("self", "request", "num_computed_tokens")),
            ("KVConnectorBase_V1.update_state_after_alloc", ("self", "request", "blocks", "num_external_tokens")),
            ("KVConnectorBase_V1.request_finished", ("self", "request", "block_ids")),
            # what the scheduler calls instead for a connector that supports the hybrid allocator (SupportsHMA:
            # NIXL, the offload connectors, MultiConnector): block ids per KV cache group
            ("SupportsHMA.request_finished_all_groups", ("self", "request", "block_ids")),
        )
    ) + (DISCARD_SITE,)  # fmt: skip


def install(kv_rows: KvRows) -> None:
    """The scheduler hook (rows follow its connector), then the generation's own patches (idempotent)."""
    patching.replace(SCHEDULER_INIT, lambda init: attaching(init, kv_rows))
    kv_rows.install()


def attaching(init: Callable[..., None], kv_rows: KvRows) -> Callable[..., None]:
    """vLLM's ``Scheduler.__init__``, then (a KV connector and routed experts on) rows follow the connector."""

    @functools.wraps(init)
    def scheduler_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        connector = getattr(self, "connector", None)
        rows = kv_rows.attach(self) if connector is not None else None
        if rows is not None:
            follow(self, connector, rows)

    return scheduler_init


# ---- per request ----


def loaded_span(request: Any) -> tuple[int, int] | None:
    """``(first token, count)`` of the request's tokens whose KV (and rows) were loaded through the KV connector,
    or ``None``. Rows of those tokens were computed on the instance that stored the KV; the others here."""
    span = getattr(request, _LOADED, None)
    return None if span is None else (int(span[0]), int(span[1]))


def held_rows(scheduler: Any) -> carriers.HeldRowsCarrier | None:
    """The rows a scheduler holds for its connector (``None``: its connector has a carrier of its own, or none)."""
    held: carriers.HeldRowsCarrier | None = getattr(scheduler, _HELD, None)
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
    requests_waited: int = 0  # loads that waited for rows still to come (MooncakeConnector: the prefill not done)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


_REPORTS = ProcessReports(KvRowsStats, kept=5)  # every scheduler of this process; the first reports for doctor


def stats() -> KvRowsStats:
    return _REPORTS.stats()


def first_reports() -> list[str]:
    return _REPORTS.first_reports()


_count = _REPORTS.count


class Follower:
    """The rows that follow one scheduler's connector."""

    def __init__(self, connector: Any, rows: SchedulerRows, carrier: carriers.Carrier, model: Any) -> None:
        self.connector = connector
        self.rows = rows
        self.carrier = carrier
        self.model = model
        self.strict = envs.VLLM_ASCEND_ROUTING_VALIDATE == "strict"
        self.offered: dict[str, tuple[int, np.ndarray]] = {}  # request -> (first token, carried rows)
        # request -> (when it first waited for rows still to come (Pending), when its store was last asked)
        self.waiting: dict[str, tuple[float, float]] = {}
        self.discarding: dict[str, int] = {}  # request -> its local hit: a declined load received, then discarded
        self.reports = 0

    def matched(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any) -> Any:
            count, load_async = original(request, num_computed_tokens, *args, **kwargs)
            self.offered.pop(request.request_id, None)
            if not count or count <= 0:
                return count, load_async
            start = int(num_computed_tokens)  # vLLM loads from the local hit it passed on
            now, waited = time.monotonic(), self.waiting.get(request.request_id)
            wait_s = envs.VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S
            if waited is not None and now - waited[1] < POLL_S and now - waited[0] < wait_s:
                return None, False  # its store was asked a moment ago: not again at this step
            carried = self.carrier.get(request, start, int(count))
            if isinstance(carried, Pending):
                if waited is None:
                    _count(requests_waited=1)
                first = now if waited is None else waited[0]
                if now - first < wait_s:
                    self.waiting[request.request_id] = (first, now)
                    return None, False  # vLLM asks again at a later step (the request stays waiting)
                carried = Missing(f"{carried.reason}; waited {wait_s} s (VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S)")
            self.waiting.pop(request.request_id, None)
            if not isinstance(carried, Missing):
                carried = self._checked(carried, request.request_id, start, "carried with that KV")
            if isinstance(carried, Missing):
                discard = bool(load_async) and getattr(self.carrier, "discards_declined", False)
                self._decline(request.request_id, start, int(count), carried.reason, discard)
                if discard:
                    # Its hand-over must complete (vLLM's MooncakeConnector reports a pull even for a declined load,
                    # and a running request's report stops the engine): received, then discarded and computed.
                    self.discarding[request.request_id] = start
                    self._settle(request)
                    return count, load_async
                return 0, False
            self.offered[request.request_id] = (start, carried)
            return count, load_async

        return get_num_new_matched_tokens

    def allocated(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int, *args: Any, **kw: Any) -> Any:
            result = original(request, blocks, num_external_tokens, *args, **kw)
            offered = self.offered.pop(request.request_id, None)
            if num_external_tokens > 0 and request.request_id in self.discarding:
                return result  # no rows: its KV is discarded once received (``discard``)
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
                self._settle(request)  # rows lent through the row store: freed once in place
                _count(requests_loaded=1, rows_loaded=int(num_external_tokens))
            return result

        return update_state_after_alloc

    def finished(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def request_finished(request: Any, block_ids: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                rows = self._finished_rows(request, block_ids)
            finally:
                self.offered.pop(request.request_id, None)
                self.waiting.pop(request.request_id, None)
                self.discarding.pop(request.request_id, None)
                self.rows.forget(request.request_id)
            finished = original(request, block_ids, *args, **kwargs)
            if rows is not None:  # after the connector: a carrier may put them into what it returned
                _count(rows_stored=self.carrier.put(request, rows, finished))
            return finished

        return request_finished

    def _settle(self, request: Any) -> None:
        """The request's load is decided (loaded, or declined for good): rows lent to it through the row store are
        freed (one load per lent prompt)."""
        settled = getattr(self.carrier, "settled", None)
        if settled is not None:
            settled(request)

    def discard(self, scheduler: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        def update_waiting_for_remote_kv(request: Any, *args: Any, **kwargs: Any) -> Any:
            start = self.discarding.pop(request.request_id, None)
            if start is not None:  # vLLM's own failed-load path: keep the local hit, compute the rest here
                request.num_computed_tokens = min(int(request.num_computed_tokens), start)
                scheduler.failed_recving_kv_req_ids.add(request.request_id)
            return original(request, *args, **kwargs)

        return update_waiting_for_remote_kv

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

    def _decline(self, request_id: str, start: int, count: int, reason: str, discarded: bool = False) -> None:
        _count(offers_declined=1, rows_declined=count)
        how = "its KV is received, then discarded" if discarded else "the load is skipped"
        self._report(
            f"vllm-ascend-routing: request {request_id}: {self.carrier.connector} offers the KV of tokens "
            f"[{start}, {start + count}) but {reason}. Those tokens are computed here instead of loaded (their "
            f"routed experts are exact; {how}).",
            error=False,
        )

    def _report(self, text: str, error: bool) -> None:
        self.reports += 1
        _REPORTS.keep(text)
        if loud(self.reports):
            (logger.error if error else logger.warning)("%s (report %d; %s)", text, self.reports, stats().as_dict())


def follow(scheduler: Any, connector: Any, rows: SchedulerRows) -> None:
    config = scheduler.vllm_config.kv_transfer_config
    if not serves(config):  # refused at model load already; a scheduler built another way stops here
        raise UnsupportedVllmError(refusal(config, "this"))
    name = type(connector).__name__
    carrier: carriers.Carrier
    if not holds_rows(config):
        named = str(connector_name(config))
        kind = registry.CARRIERS[named]
        carrier = (
            kind(connector, rows.layout, name=named)
            if kind is carriers.TransferParamsCarrier
            else kind(connector, rows.layout)
        )
        where = f"carried with its KV ({rows.layout} per token)"
    else:
        capacity = envs.VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB << 20
        held = carriers.HeldRowsCarrier(name, rows.layout, scheduler.vllm_config.cache_config.block_size, capacity)
        setattr(scheduler, _HELD, held)
        carrier = shared.with_store(held, str(connector_name(config)), str(scheduler.vllm_config.model_config.model))
        # around: the scheduler class's reset_prefix_cache is another patch's replacement (output.engine)
        patching.wrap(
            scheduler, "reset_prefix_cache", functools.partial(_dropping_held_rows, held=carrier), around=True
        )
        where = (
            f"of KV this instance computed held here (up to {capacity >> 20} MiB, "
            "VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB); KV computed elsewhere is computed here instead"
            if carrier is held
            else f"of KV this instance computed held here (up to {capacity >> 20} MiB); of salted requests' blocks "
            "also in the row store, so that another instance's hit on this cache loads them (kv.shared)"
        )
    model = validate.ModelRouting.from_vllm_config(scheduler.vllm_config)
    follower = Follower(connector, rows, carrier, model)
    patching.wrap(connector, "get_num_new_matched_tokens", follower.matched)
    patching.wrap(connector, "update_state_after_alloc", follower.allocated)
    patching.wrap(connector, "request_finished", follower.finished)
    if hasattr(connector, "request_finished_all_groups"):  # SupportsHMA: vLLM's scheduler calls this one instead
        patching.wrap(connector, "request_finished_all_groups", follower.finished)
    if getattr(carrier, "discards_declined", False):
        patching.wrap(scheduler, "_update_waiting_for_remote_kv", functools.partial(follower.discard, scheduler))
    logger.info("routed experts follow KV connector %s: rows of loaded tokens %s", name, where)


def _dropping_held_rows(
    original: Callable[..., Any], held: carriers.HeldRowsCarrier | shared.SharedCacheCarrier
) -> Callable[..., Any]:
    def reset_prefix_cache(*args: Any, **kwargs: Any) -> Any:
        held.clear()  # before the reset: a load after it must not find rows of the weights before it
        return original(*args, **kwargs)

    return reset_prefix_cache
