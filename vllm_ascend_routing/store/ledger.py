# SPDX-License-Identifier: Apache-2.0
"""The engine core's side of a store: publish a finished request's rows under a fresh key, within the byte cap, for
the lifetime the settings give them.

An object lives until the trainer releases it (``replay.release``), its TTL passes (``VLLM_ASCEND_ROUTING_STORE_TTL_S``,
checked at each publish), or the engine shuts down (``close``: this engine's live objects are removed). The byte cap
(``VLLM_ASCEND_ROUTING_STORE_MIB``) counts this engine's live objects; releases made by another process are noticed
when the cap would be passed (the objects still present are counted again). Past the cap ``publish`` raises
``StoreFullError``: the caller returns that request's rows inline instead, with the reason in its record.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.store import keys, layout
from vllm_ascend_routing.store.interface import Backend, StoreError, StoreFullError
from vllm_ascend_routing.store.keys import Namespace

logger = get_logger(__name__)


@dataclass
class _Entry:
    nbytes: int
    deadline: float  # clock() after which the object is removed (inf: no TTL)


@dataclass
class LedgerStats:
    published: int = 0
    published_bytes: int = 0
    expired: int = 0
    refused_full: int = 0


class Ledger:
    """One engine core's objects in ``backend``: their keys, sizes and deadlines."""

    def __init__(
        self,
        backend: Backend,
        namespace: Namespace,
        cap_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend, self.namespace = backend, namespace
        self.cap_bytes, self.ttl_s, self.clock = cap_bytes, ttl_s, clock
        self.entries: OrderedDict[str, _Entry] = OrderedDict()  # publish order: the oldest deadline first
        self.live_bytes = 0
        self.stats = LedgerStats()

    def publish(self, rows: np.ndarray, first_token: int, tokens_sha256: str = "", key: str | None = None) -> str:
        """Store ``rows`` (``[T, L, K]`` as vLLM returns them) and return their key, once they are readable
        (``key``: one minted here beforehand, else a fresh one).

        Raises:
            StoreFullError: past the byte cap, or the backend has no room. StoreUnavailableError: unreachable.
        """
        self.expire()
        key = key or self.namespace.key()
        parts, _ = layout.encode(key, rows, first_token, tokens_sha256)
        nbytes = sum(len(part) for part in parts)
        if self.live_bytes + nbytes > self.cap_bytes:
            self.recount()
        if self.live_bytes + nbytes > self.cap_bytes:
            self.stats.refused_full += 1
            raise StoreFullError(
                f"the store holds {self.live_bytes / 2**20:.1f} MiB of this engine's rows and these need "
                f"{nbytes / 2**20:.1f} MiB more, past VLLM_ASCEND_ROUTING_STORE_MIB={self.cap_bytes // 2**20}: "
                "release fetched keys (replay.release) or raise the cap"
            )
        self.backend.put(key, parts)
        deadline = self.clock() + self.ttl_s if self.ttl_s > 0 else float("inf")
        self.entries[key] = _Entry(nbytes, deadline)
        self.live_bytes += nbytes
        self.stats.published += 1
        self.stats.published_bytes += nbytes
        return key

    def name(self, name: str, key: str) -> None:
        """Store, under ``name`` (``keys.derive``), a pointer to ``key`` (published here): it lives as long as the
        rows do (removed with them on expiry or at shutdown; a reader that releases one releases both).

        Raises:
            StoreError: the name is taken (names are written once). StoreUnavailableError: unreachable.
        """
        deadline = self.entries[keys.object_of(key)].deadline  # a key this ledger published (``@rows``: a part)
        self._put_name(name, layout.encode_pointer(name, key, self.namespace.instance), deadline)

    def publish_blocks(self, rows: np.ndarray, names: list[tuple[str, int]]) -> list[str]:
        """Each ``(name, end)`` pointing to the first ``end`` of ``rows`` (from token 0), in one batch where the backend
        allows; a name taken already is left as it is. The pointers go first, to a key minted for the rows, and the rows
        are published only where a name was free: a request whose blocks are all named already (``n`` samples of one
        prompt) costs one existence check, no rows. A reader between the two finds the name but not yet its rows and
        computes those tokens (never other rows). The names written, each living as long as the rows.

        Raises:
            StoreError: the rows could not be published (the names written are removed again).
        """
        key = self.namespace.key()
        encoded = {
            name: (b"".join(map(bytes, layout.encode_pointer(name, f"{key}@{end}", self.namespace.instance))), end)
            for name, end in names
        }
        written = self.backend.put_new([(name, data) for name, (data, _) in encoded.items()])
        if not written:
            return []
        try:
            self.publish(rows[: max(encoded[name][1] for name in written)], 0, key=key)
        except StoreError:
            for name in written:
                with contextlib.suppress(StoreError):
                    self.backend.remove(name)
            raise
        deadline = self.entries[key].deadline
        for name in written:
            self.entries[name] = _Entry(len(encoded[name][0]), deadline)
            self.live_bytes += len(encoded[name][0])
        return written

    def mark(self, name: str, reason: str) -> None:
        """Store, under ``name``, that no rows were stored for it and why (its reader declines at once instead of
        waiting for rows that will not come). Raises as ``name``."""
        parts = layout.encode_pointer(name, None, self.namespace.instance, reason)
        self._put_name(name, parts, self.clock() + self.ttl_s if self.ttl_s > 0 else float("inf"))

    def _put_name(self, name: str, parts: list[memoryview], deadline: float) -> None:
        self.backend.put(name, parts)
        nbytes = sum(len(part) for part in parts)
        self.entries[name] = _Entry(nbytes, deadline)  # expires with its key (published just before)
        self.live_bytes += nbytes

    def remove(self, key: str) -> None:
        """Remove one of this ledger's objects now."""
        self._forget(key)
        self.backend.remove(key)

    def expire(self) -> int:
        """Remove the objects whose TTL has passed; how many."""
        now, gone = self.clock(), 0
        while self.entries:
            key, entry = next(iter(self.entries.items()))
            if entry.deadline > now:
                break
            self._forget(key)
            self.backend.remove(key)
            gone += 1
        self.stats.expired += gone
        return gone

    def recount(self) -> None:
        """Forget the objects a trainer released (no longer in the store)."""
        for key in [key for key in self.entries if self.backend.size(key) is None]:
            self._forget(key)

    def close(self) -> None:
        """The engine's shutdown: remove every live object of this engine."""
        for key in list(self.entries):
            self._forget(key)
            try:
                self.backend.remove(key)
            except Exception as error:  # noqa: BLE001 (shutdown: the rest are still removed)
                logger.warning("routed-experts store: removing %s at shutdown failed: %s", key, error)
        self.backend.close()

    def _forget(self, key: str) -> None:
        entry = self.entries.pop(key)
        self.live_bytes -= entry.nbytes
