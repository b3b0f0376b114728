# SPDX-License-Identifier: Apache-2.0
"""Rows of KV lent between instances that share nothing but an identifier: vLLM's ``MooncakeConnector`` (P/D).

Its proxy sends the prefill request ``{"do_remote_decode": true, "transfer_id": T}`` and, at the same time, the decode
request ``{"do_remote_prefill": true, "transfer_id": T, ...}`` it built itself: nothing the prefill instance returns
reaches the decode instance, so no rows or key can ride in the parameters. The rows go through the row store
(``VLLM_ASCEND_ROUTING_STORE``) under a name both derive from ``T`` (``store.keys.derive`` with the deployment's
``VLLM_ASCEND_ROUTING_KV_SECRET``): the prefill scheduler publishes them when its request finishes, before its
connector lets the KV go; the decode scheduler, which may see its request first, waits for them
(``carriers.Pending``) as its connector waits for the KV, up to ``VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S``. The stored
token digest is checked against the decode request's prompt; loaded rows are freed. Rows the prefill could not store
are marked so under the same name: the decode request declines at once, with the reason. A load without exact rows is
declined as vLLM declines a failed load: its KV is received (the connector's hand-over runs to its end) and
discarded, and the prompt computed here from the local hit.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.kv.carriers import (
    Missing,
    Pending,
    RowLayout,
    digest,
    kv_secret,
    release_quietly,
    rows_from_store,
)
from vllm_ascend_routing.store import keys
from vllm_ascend_routing.store import publisher as store_publisher
from vllm_ascend_routing.store import reader as store_reader
from vllm_ascend_routing.store.interface import NothingStoredError, StoreError, UnknownKeyError

logger = get_logger(__name__)

SCOPE = "mooncake-transfer"  # what the derived names are of (another use of a transfer id never collides)


class TransferIdCarrier:
    """vLLM's ``MooncakeConnector``: rows under a name derived from the request's ``transfer_id``."""

    connector = "MooncakeConnector"
    # Its hand-over runs to its end even for a declined load (its worker reports the pull, and vLLM's scheduler stops
    # on a report for a running request): a declined load is received, then discarded and computed (kv.follower).
    discards_declined = True

    def __init__(self, connector: Any, layout: RowLayout, secret: bytes | None = None) -> None:
        self._connector = connector
        self.layout = layout
        self._secret = kv_secret() if secret is None else secret

    def name(self, transfer_id: str) -> str:
        return keys.derive(self._secret, SCOPE, transfer_id)

    def put(self, request: Any, rows: np.ndarray, finished: Any = None) -> int:
        delay_free, _ = finished if isinstance(finished, tuple) and len(finished) == 2 else (False, None)
        params = getattr(request, "kv_transfer_params", None)
        if not delay_free or not isinstance(params, dict) or not params.get("do_remote_decode"):
            return 0  # the connector lends no KV of this request
        transfer = params.get("transfer_id")
        publisher = store_publisher.for_engine()
        if not transfer or publisher is None:  # no store: refused at start-up (kv.policy)
            return 0
        sequence = getattr(request, "all_token_ids", None)
        tokens = np.asarray(list((request.prompt_token_ids if sequence is None else sequence) or []), dtype=np.int64)
        end = min(len(tokens), len(rows))
        name = self.name(str(transfer))
        try:
            publisher.publish_named(np.ascontiguousarray(rows[:end]), digest(tokens[:end]), name)
        except StoreError as error:  # the decode instance computes that prompt (exact), told at once where it can be
            logger.warning("routed-experts store: the rows of Mooncake transfer %s are not lent: %s", transfer, error)
            # where even that fails, the decode instance waits for them until VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S
            with contextlib.suppress(StoreError):
                publisher.mark_unlent(name, f"{type(error).__name__}: {error}")
            return 0
        return end

    def get(self, request: Any, start: int, count: int) -> np.ndarray | Missing | Pending:
        params = getattr(request, "kv_transfer_params", None) or {}
        transfer = params.get("transfer_id") if isinstance(params, dict) else None
        if not transfer:
            return Missing("its kv_transfer_params name no transfer_id (not a MooncakeConnector hand-over)")
        try:
            key = store_reader.resolve(self.name(str(transfer)))
        except NothingStoredError as error:
            return Missing(f"the prefill instance stored no rows for Mooncake transfer {transfer} ({error.reason})")
        except UnknownKeyError:
            return Pending(
                f"the rows of Mooncake transfer {transfer} are not in the row store (its prefill has not finished, or "
                "the prefill instance runs without vllm-ascend-routing or with another VLLM_ASCEND_ROUTING_STORE or "
                "VLLM_ASCEND_ROUTING_KV_SECRET)"
            )
        except (StoreError, ValueError) as error:
            return Missing(f"the routing rows of Mooncake transfer {transfer} cannot be read from the store: {error}")
        return rows_from_store(request, key, start, count, self.layout, f"of Mooncake transfer {transfer}")

    def settled(self, request: Any) -> None:
        """The load is decided (loaded where vLLM reads them, or declined): the name and its rows are freed (one
        load per transfer)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        transfer = params.get("transfer_id") if isinstance(params, dict) else None
        if not transfer:
            return
        name = self.name(str(transfer))
        try:
            key = store_reader.resolve(name)
        except (StoreError, ValueError):
            return
        release_quietly(key)
        release_quietly(name)
