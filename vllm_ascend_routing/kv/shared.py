# SPDX-License-Identifier: Apache-2.0
"""Rows of KV in a cache service other instances share (vLLM's ``MooncakeStoreConnector`` and ``LMCacheMPConnector``,
vllm-ascend's KV pool; ``SHARED_CACHES``): kept in the row store beside it, so that a hit on KV another instance
computed loads with that instance's rows instead of being computed again.

The weight-version rule. Those caches key KV by the model and the chain of vLLM's block hashes, not by the weights,
and keep the first value put under a key: after a weight update they serve KV computed before it. vLLM's block
hashes include the request's ``cache_salt``, so a deployment whose requests carry the weight version as their salt
(the same on every instance, changed at every update) never loads KV across versions. Rows are shared only under
that rule: each whole block's rows go under a name derived (``store.keys.derive``, the deployment's
``VLLM_ASCEND_ROUTING_KV_SECRET``) from the model, the salt and the chain of token ids up to the block's end, so KV
and rows of one block are found by the same tokens, salt and model, or not at all. A request without a salt keeps
today's behaviour (``carriers.HeldRowsCarrier``: rows of KV this instance computed; another instance's KV is
computed here). A salt this instance saw before its last prefix-cache reset (vLLM's RL integrations reset it after
a weight update) does not name one weight version: its shared rows are neither stored nor loaded, and it says so.

Within a version, a name is written once (the first instance to finish the block), as the cache keeps its first KV;
rows and KV of the same tokens, salt and weights are the same computation's wherever the MoE's routing does not
depend on the batch it ran in (``docs/disaggregation.md``). Rows live as the row store keeps rows (their TTL, the
writing engine's life, its byte cap); a block whose rows are gone is computed here, never loaded without them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from vllm_ascend_routing import envs
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.kv.carriers import HeldRowsCarrier, Missing, kv_secret
from vllm_ascend_routing.store import keys
from vllm_ascend_routing.store import publisher as store_publisher
from vllm_ascend_routing.store import reader as store_reader
from vllm_ascend_routing.store.interface import NothingStoredError, StoreError, UnknownKeyError
from vllm_ascend_routing.store.layout import StoredRows

logger = get_logger(__name__)

SCOPE = "shared-kv-cache"  # what the derived names are of (a transfer id's names never collide with these)
# Connectors whose KV other instances load (a cache service) and whose KV keys include the cache salt (read in their
# source: vLLM's block hashes, or the salt passed on): with a row store and a deployment secret their blocks' rows are
# shared. Every other served connector keeps its rows in the scheduler only (LMCacheConnectorV1 among them: its keys
# are the lmcache package's own, not checked here).
SHARED_CACHES = (
    "MooncakeStoreConnector",  # vLLM 0.30+: keys of request.block_hashes
    "LMCacheMPConnector",  # vLLM: request.cache_salt passed to the LMCache server with the block hashes
    "AscendStoreConnector",  # vllm-ascend's KV pool: keys of request.block_hashes
    "MooncakeConnectorStoreV1",  # vllm-ascend: the same class under its older name
)
_SALTS_KEPT = 4096  # salts remembered with the reset they were first seen after (a few per weight version)
NO_SALT = (
    "the request carries no cache_salt, and rows of KV another instance computed are loaded only for requests whose "
    "cache_salt names the weight version (docs/disaggregation.md, the weight-version rule)"
)


class SharedCacheCarrier:
    """Held rows (``held``) first; for a salted request, each whole block's rows also in the row store by name."""

    def __init__(self, held: HeldRowsCarrier, model: str, secret: bytes | None = None) -> None:
        self.held = held
        self.connector = held.connector
        self.layout = held.layout
        self.model = model  # with the layout, what else names a block's rows (another model's are never found)
        self._secret = kv_secret() if secret is None else secret
        self.resets = 0  # prefix-cache resets seen (weight updates)
        self._salts: OrderedDict[str, int] = OrderedDict()  # salt -> the reset count it was first seen at
        self.names_written = 0

    def name(self, salt: str, chain: bytes) -> str:
        """The name of one block's rows: its chain key (every token up to its end, LoRA, multimodal inputs) under
        this model, layout and salt."""
        layout = f"{self.layout.num_layers}x{self.layout.top_k}:{self.layout.dtype}"
        return keys.derive(self._secret, SCOPE, f"{self.model}\0{layout}\0{salt}\0{chain.hex()}")

    def _salt(self, request: Any) -> tuple[str | None, str]:
        """The request's salt where its shared rows may be used, else ``None`` and why."""
        salt = getattr(request, "cache_salt", None)
        if not salt:
            return None, NO_SALT
        first = self._salts.setdefault(str(salt), self.resets)
        self._salts.move_to_end(str(salt))
        while len(self._salts) > _SALTS_KEPT:
            self._salts.popitem(last=False)
        if first != self.resets:
            return None, (
                f"its cache_salt {salt!r} was used here before a prefix-cache reset (a weight update) and again after "
                "it, so it does not name one weight version: rows of KV another instance computed under it could be "
                "of other weights than that KV (give every weight version its own cache_salt)"
            )
        return str(salt), ""

    def put(self, request: Any, rows: np.ndarray, finished: Any = None) -> int:
        stored = self.held.put(request, rows, finished)
        salt, _ = self._salt(request)
        publisher = store_publisher.for_engine()
        if salt is None or publisher is None:
            return stored
        sequence = getattr(request, "all_token_ids", None)
        tokens = np.asarray(list((request.prompt_token_ids if sequence is None else sequence) or []), dtype=np.int64)
        size = self.held.block_size
        end = min(len(tokens), len(rows)) // size * size  # the whole blocks: what a cache stores and offers
        if end == 0:
            return stored
        names = [(self.name(salt, key), last) for _, key, _, last in self.held.chain(request, tokens, end)]
        try:
            self.names_written += publisher.publish_blocks(np.ascontiguousarray(rows[:end]), names)
        except StoreError as error:  # those blocks' loads elsewhere are computed there (exact)
            logger.warning("routed-experts store: rows of shared-cache blocks not stored: %s", error)
        return stored

    def get(self, request: Any, start: int, count: int) -> np.ndarray | Missing:
        local = self.held.get(request, start, count)
        if not isinstance(local, Missing):
            return local
        salt, why = self._salt(request)
        if salt is None:
            return Missing(f"{local.reason}; {why}")
        tokens = np.asarray(list(request.prompt_token_ids or []), dtype=np.int64)
        size, end = self.held.block_size, start + count
        whole = min(-(-end // size) * size, len(tokens) // size * size)  # blocks covering the load, inside the prompt
        if whole < end:
            return Missing(f"{local.reason}; the load ends in the prompt's last, partial block (never shared)")
        # The name of the block the load ends in commits to every token before it: its object holds the rows of
        # that whole prefix (one writer's computation of it), read in one range.
        *_, (_, chain, first, last) = self.held.chain(request, tokens, whole)
        found = self._prefix(self.name(salt, chain), first, last)
        if isinstance(found, Missing):
            return Missing(f"{local.reason}; {found.reason}")
        return np.ascontiguousarray(found.window(start, end).read())

    def _prefix(self, name: str, first: int, last: int) -> StoredRows | Missing:
        """The rows of tokens ``[0, last)`` under ``name``, the name of the block ``[first, last)`` (a pointer to
        ``key@last``: the first ``last`` rows of the object its writer stored)."""
        try:
            stored = store_reader.open_rows(store_reader.resolve(name))
        except (UnknownKeyError, NothingStoredError):
            return Missing(
                f"no instance's rows of the block of tokens [{first}, {last}) are in the row store under this model, "
                "layout and cache_salt (never stored, expired, or their engine has exited)"
            )
        except (StoreError, ValueError) as error:
            return Missing(f"the shared rows of tokens [0, {last}) cannot be read from the store: {error}")
        if len(stored) != last or (stored.dtype, stored.shape[1:]) != (
            np.dtype(self.layout.dtype),
            (self.layout.num_layers, self.layout.top_k),
        ):
            return Missing(f"the shared rows of tokens [0, {last}) are {stored.shape} {stored.dtype}: not these")
        return stored

    def clear(self) -> None:
        """vLLM's prefix cache reset (the weights may have changed): held rows dropped, and every salt seen so far
        no longer names the weights from now on."""
        self.held.clear()
        self.resets += 1


def with_store(held: HeldRowsCarrier, name: str, model: str) -> HeldRowsCarrier | SharedCacheCarrier:
    """The carrier for served connector ``name``: shared rows where it is a cache service and the deployment has a
    row store and a secret, else the held rows alone."""
    if name not in SHARED_CACHES or store_publisher.for_engine() is None or not envs.VLLM_ASCEND_ROUTING_KV_SECRET:
        return held
    return SharedCacheCarrier(held, model)
