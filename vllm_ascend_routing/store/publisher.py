# SPDX-License-Identifier: Apache-2.0
"""The engine core publishes each finished request's rows once, and only a key leaves the process.

vLLM's scheduler sends a request's rows to the front end in chunks, one per step (0.22+). On a store engine the
output feature (``output.engine``) hands each chunk of a request bound for the store to ``hold`` instead, and at the
request's last output ``publish`` stores the whole array and returns the key, before that output leaves the engine
core: a key is never seen before its rows are readable. Where the store is full or unreachable the rows go inline
with that output instead, and the record says why: a request never loses its rows.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_ascend_routing import envs
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.reporting import loud
from vllm_ascend_routing.store import setting as store_setting
from vllm_ascend_routing.store.interface import StoreError
from vllm_ascend_routing.store.keys import Namespace
from vllm_ascend_routing.store.ledger import Ledger

logger = get_logger(__name__)

STORE_KEY = "store_key"  # the record's key of a stored request (routed_experts_info)
FALLBACK = "store_fallback"  # the record's reason where a request's rows went inline on a store engine
VIOLATIONS = "store_violations"  # validation mode: what the stored-to-be rows broke (nothing stored, the request fails)


class Publisher:
    """One engine core's pending chunks and its ledger (opened at the first publish)."""

    def __init__(self, setting: store_setting.Setting, dp_rank: int) -> None:
        self.setting, self.dp_rank = setting, dp_rank
        self.chunks: dict[str, list[np.ndarray]] = {}
        self._ledger: Ledger | None = None
        self._lock = threading.Lock()
        self.fallbacks = 0

    def ledger(self) -> Ledger:
        if self._ledger is None:
            cap = envs.VLLM_ASCEND_ROUTING_STORE_MIB * 2**20
            backend = store_setting.open_backend(self.setting, writer_bytes=cap)
            self._ledger = Ledger(backend, Namespace.mint(self.dp_rank), cap, envs.VLLM_ASCEND_ROUTING_STORE_TTL_S)
            atexit.register(self.close)
        return self._ledger

    def hold(self, request_id: str, chunk: np.ndarray) -> None:
        self.chunks.setdefault(request_id, []).append(chunk)

    def drop(self, request_id: str) -> None:
        """A request that ended without a last output (aborted): its chunks are not published."""
        self.chunks.pop(request_id, None)

    def publish(
        self,
        request_id: str,
        first_token: int,
        violations: Callable[[str, np.ndarray], list[Any]] | None = None,
        strict: bool = False,
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        """The record's store fields for a finished request, and the rows to return inline (``None``: stored, or it
        has none). ``violations``: validation mode's check of the whole array, run here where the array exists (the
        front end never sees stored rows); what it finds goes into the record (``VIOLATIONS``), and with ``strict``
        the rows are not stored (the front end fails the request, as for a returned array)."""
        chunks = self.chunks.pop(request_id, None)
        if not chunks:
            return {}, None
        rows = chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=0)
        found = [str(v) for v in violations(request_id, rows)] if violations is not None else []
        if found and strict:
            return {VIOLATIONS: found}, None
        fields, inline = self._store(request_id, rows, first_token)
        return ({**fields, VIOLATIONS: found} if found else fields), inline

    def _store(self, request_id: str, rows: np.ndarray, first_token: int) -> tuple[dict[str, Any], np.ndarray | None]:
        try:
            with self._lock:
                key = self.ledger().publish(rows, first_token)
        except (StoreError, OSError) as error:
            self.fallbacks += 1
            if loud(self.fallbacks):
                logger.warning(
                    "routed-experts store: request %s's rows are returned inline (fallback %d): %s",
                    request_id,
                    self.fallbacks,
                    error,
                )
            return {FALLBACK: f"{type(error).__name__}: {error}"}, rows
        return {
            STORE_KEY: key,
            "stored_rows": int(rows.shape[0]),
            "dtype": str(rows.dtype),
            "shape": [int(n) for n in rows.shape],
        }, None

    def publish_rows(self, rows: np.ndarray, tokens_sha256: str) -> str:
        """Rows of a prompt's KV lent to another instance (P/D), with the digest of their token ids: their key.
        Raises ``StoreError`` (the caller carries the rows inline instead)."""
        with self._lock:
            return self.ledger().publish(rows, 0, tokens_sha256)

    def publish_named(self, rows: np.ndarray, tokens_sha256: str, name: str) -> str:
        """Rows lent to another instance that finds them by ``name`` (``keys.derive`` of what both share: vLLM's
        ``MooncakeConnector`` passes a transfer id only): published as ``publish_rows``, then the name points to them.
        Raises ``StoreError`` (nothing is left stored: the other instance computes those tokens)."""
        with self._lock:
            ledger = self.ledger()
            key = ledger.publish(rows, 0, tokens_sha256)
            try:
                ledger.name(name, key)
            except StoreError:
                ledger.remove(key)
                raise
            return key

    def publish_blocks(self, rows: np.ndarray, names: list[tuple[str, int]]) -> int:
        """Rows of a shared cache's blocks (``kv.shared``): each ``(name, end)`` pointing to the first ``end`` of
        ``rows`` (from token 0), the rows published where a name was free; a name taken already (another instance's
        rows of the same block, or an earlier request's here: the first written is kept, as the cache keeps its first
        KV) is left as it is (``Ledger.publish_blocks``). How many names were written. Raises ``StoreError`` where the
        rows cannot be published (nothing of them is left stored)."""
        with self._lock:
            return len(self.ledger().publish_blocks(rows, names))

    def mark_unlent(self, name: str, reason: str) -> None:
        """Say under ``name`` that its rows were not stored (``reason``): the other instance declines at once rather
        than waiting for them. Raises ``StoreError`` (the store cannot take even that: the other instance waits)."""
        with self._lock:
            self.ledger().mark(name, reason)

    def close(self) -> None:
        with self._lock:
            if self._ledger is not None:
                self._ledger.close()
                self._ledger = None


_publishers: dict[int, Publisher] = {}


def for_engine(dp_rank: int | None = None) -> Publisher | None:
    """This process's publisher for the engine of ``dp_rank``, ``None`` without a store. ``dp_rank`` ``None``: the one
    this process already has (an engine core runs one engine: the KV carrier's rows share its ledger, its byte cap
    and its lease), else one for rank 0."""
    found = store_setting.current()
    if found is None:
        return None
    if dp_rank is None:
        if _publishers:
            return next(iter(_publishers.values()))
        dp_rank = 0
    if dp_rank not in _publishers:
        _publishers[dp_rank] = Publisher(found, dp_rank)
    return _publishers[dp_rank]
