# SPDX-License-Identifier: Apache-2.0
"""Where routing rows travel with KV that a connector moves: beside that KV, in the connector's own storage,
under the connector's own key, so that whatever finds the KV finds its rows.

One carrier per connector whose storage the plugin writes into (``kv.registry.CARRIERS``, by the name in
``--kv-transfer-config``), and one for every other connector it serves (``HeldRowsCarrier``):

  * ``ExampleConnector`` (vLLM's shared-storage connector: KV of a prompt's first whole blocks, one folder per
    prompt prefix, named by a hash of its token ids): the rows of those tokens go into the same folder as one
    file, ``ROWS_FILE``, with the token ids they belong to. Written by the scheduler of the instance whose
    connector stored the KV, when the request finishes (its rows are complete then); read by the scheduler of an
    instance whose connector offers that KV, before it loads it.
  * ``NixlConnector`` and vllm-ascend's Mooncake P/D connectors that return parameters alike (P/D disaggregation:
    the decode instance reads the prefill instance's KV blocks, which the
    prefill instance describes in the ``kv_transfer_params`` it returns and the proxy passes on): the rows of those
    prompt tokens go into the same parameters (``TransferParamsCarrier``). Written by the prefill scheduler when the
    request finishes; read by the decode scheduler, with the token ids they belong to checked, before it loads.
  * vLLM's ``MooncakeConnector`` (P/D, whose parameters the proxy builds: only a transfer id is shared): through the
    row store, under a name both instances derive from that id (``kv.named``).
  * any other served connector (an offload tier, a cache service, a custom connector: storage the plugin cannot
    write into): the rows of requests computed on this instance (prompts, and on vLLM 0.22-0.30 their generated
    tokens) are held in the scheduler's memory, keyed by their token ids block by block. A load of KV this
    instance computed (offloaded, evicted, then restored) gets them; KV another instance computed finds none, and
    is computed here instead.

A carrier never guesses: rows are returned only for exactly the tokens asked, stored with those very token ids,
in this engine's layout; anything else is ``Missing`` with the reason, and the caller computes those tokens
instead of loading them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import io
import os
import secrets
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from vllm_ascend_routing import envs
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.patching import RELY, Patch
from vllm_ascend_routing.store import publisher as store_publisher
from vllm_ascend_routing.store import reader as store_reader
from vllm_ascend_routing.store.interface import StoreError

logger = get_logger(__name__)

ROWS_FILE = "vllm_ascend_routing_rows.npz"
_PROCESS_SECRET = secrets.token_bytes(32)  # without VLLM_ASCEND_ROUTING_KV_SECRET: rows this process lent only


def kv_secret() -> bytes:
    """The key that signs rows carried in ``kv_transfer_params``: the deployment's (``VLLM_ASCEND_ROUTING_KV_SECRET``,
    the same on every instance), else this process's own."""
    shared = envs.VLLM_ASCEND_ROUTING_KV_SECRET
    return shared.encode() if shared else _PROCESS_SECRET


_FORMAT = 1
_EXAMPLE = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"


def patches() -> tuple[Patch, ...]:
    """What the carriers rely on in vLLM (optional in the manifest: ``policy.refuse_uncovered`` requires them once
    the connector is configured)."""
    return (
        Patch(
            f"{_EXAMPLE}:ExampleConnector._generate_foldername_debug",
            "ExampleConnector's folder for a prompt prefix: the rows are stored beside that KV",
            "never while ExampleConnector is covered",
            params=("self", "token_ids", "mm_hashes"),
            required=False,
            action=RELY,
        ),
        Patch(
            f"{_EXAMPLE}:align_to_block_size",
            "how many prompt tokens ExampleConnector stores (its whole blocks)",
            "never while ExampleConnector is covered",
            params=("num_tokens", "block_size"),
            required=False,
            action=RELY,
        ),
    )


@dataclass(frozen=True)
class RowLayout:
    """The shape of one token's rows in this engine: ``[num_layers, top_k]`` of ``dtype``."""

    num_layers: int
    top_k: int
    dtype: str

    def matches(self, rows: np.ndarray) -> bool:
        return rows.ndim == 3 and rows.shape[1:] == (self.num_layers, self.top_k) and rows.dtype.name == self.dtype


@dataclass(frozen=True)
class Missing:
    """Why no rows can be carried for a load."""

    reason: str


@dataclass(frozen=True)
class Pending:
    """The rows may still come (the instance lending them has not finished its prefill): ask again later, up to
    ``VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S``; then they are missing for ``reason``."""

    reason: str


class Carrier(Protocol):
    """Rows beside one connector's KV."""

    connector: str

    def put(self, request: Any, rows: np.ndarray, finished: Any) -> int:
        """Store the rows of the request's tokens from token 0 on (``rows[i]``: token ``i``; the prompt's, then
        possibly generated tokens') beside the KV its connector stored for it; ``finished`` is what the connector's
        ``request_finished`` returned for it. Returns how many rows were stored (0: the connector stored no KV for
        it, or they are stored already)."""

    def get(self, request: Any, start: int, count: int) -> np.ndarray | Missing | Pending:
        """The rows of the request's prompt tokens ``[start, start + count)``, whose KV the connector offers."""


class SharedStorageCarrier:
    """vLLM's ``ExampleConnector``: one folder per stored prompt prefix (its whole blocks), named from the
    prefix's token ids by the connector's own method; the rows go into that folder."""

    connector = "ExampleConnector"

    def __init__(self, connector: Any, layout: RowLayout, align: Callable[[int, int], int] | None = None) -> None:
        """``align(num_tokens, block_size)``: how many of a prompt's tokens the connector stores (default: the
        connector module's own ``align_to_block_size``)."""
        if align is None:
            from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector

            align = example_connector.align_to_block_size
        self._connector = connector
        self._align = align
        self._block_size = int(connector._block_size)
        self.layout = layout

    def _folder(self, request: Any, num_tokens: int) -> str:
        import torch

        tokens = torch.tensor(list(request.prompt_token_ids or []))[:num_tokens]
        mm_hashes = [feature.identifier for feature in getattr(request, "mm_features", None) or []]
        return str(self._connector._generate_foldername_debug(tokens, mm_hashes, create_folder=False))

    def put(self, request: Any, rows: np.ndarray, finished: Any = None) -> int:
        prompt = list(request.prompt_token_ids or [])
        stored = self._align(len(prompt), self._block_size)  # the prompt tokens whose KV the connector stores
        if stored <= 0 or len(rows) < stored:
            return 0
        folder = self._folder(request, stored)
        path = os.path.join(folder, ROWS_FILE)
        if not os.path.isdir(folder) or os.path.exists(path):
            return 0  # no KV stored for this prompt here, or its rows are there already
        _write(path, np.asarray(prompt[:stored], dtype=np.int64), rows[:stored], self.layout)
        return stored

    def get(self, request: Any, start: int, count: int) -> np.ndarray | Missing:
        end = start + count
        path = os.path.join(self._folder(request, end), ROWS_FILE)
        if not os.path.exists(path):
            return Missing(
                f"no routing rows are stored beside that KV ({path} is absent: the instance that stored the KV "
                "ran without vllm-ascend-routing or without --enable-return-routed-experts, or the file was removed)"
            )
        try:
            tokens, rows = _read(path, self.layout)
        except (OSError, ValueError, KeyError) as error:
            return Missing(f"the rows stored beside that KV cannot be read ({path}: {error})")
        prompt = np.asarray(list(request.prompt_token_ids or [])[:end], dtype=np.int64)
        if len(tokens) < end or not np.array_equal(tokens[:end], prompt):
            return Missing(f"the rows stored in {path} are of other tokens than this prompt's first {end}")
        return np.ascontiguousarray(rows[start:end])


class TransferParamsCarrier:
    """vLLM's ``NixlConnector`` (pull mode): the instance that computed a request's KV returns, from
    ``request_finished``, the ``kv_transfer_params`` that describe its blocks; the client or proxy passes them with
    the next request (the decode request, or a later turn on the prefill instance), whose instance reads those
    blocks. The rows go into those parameters (``FIELD``: the token ids and their rows, base64 of one ``.npz``), so
    they reach exactly the request that loads that KV, whatever routes it there.

    Those parameters pass through the client and the proxy, so what arrives may be forged, and a loaded block serves
    later prefix hits of other requests: the rows are signed (``MAC_FIELD``: HMAC-SHA256 with this deployment's
    ``VLLM_ASCEND_ROUTING_KV_SECRET``, the same on every instance; unset, a secret of this process's own, so only rows
    this instance lent itself are accepted), and rows without a valid signature are never loaded.

    With a row store (``VLLM_ASCEND_ROUTING_STORE``) the parameters carry a key instead (``KEY_FIELD``): the rows go
    through the store, not through the proxy. The engine writes, beside them, the digest of the token ids they belong
    to; a key nobody minted resolves to nothing, and a key of other tokens is refused on that digest."""

    connector = "NixlConnector"
    FIELD = "vllm_ascend_routing_rows"
    MAC_FIELD = "vllm_ascend_routing_rows_mac"
    KEY_FIELD = "vllm_ascend_routing_rows_key"  # with a row store: the rows' key instead of the rows

    def __init__(self, connector: Any, layout: RowLayout, secret: bytes | None = None, name: str = "") -> None:
        self._connector = connector
        self.layout = layout
        self._secret = kv_secret() if secret is None else secret
        self.connector = name or type(self).connector  # the configured name (vllm-ascend's Mooncake ones too)

    def _mac(self, payload: bytes) -> str:
        return hmac.new(self._secret, payload, hashlib.sha256).hexdigest()

    def put(self, request: Any, rows: np.ndarray, finished: Any = None) -> int:
        delay_free, params = finished if isinstance(finished, tuple) and len(finished) == 2 else (False, None)
        if not delay_free or not isinstance(params, dict):
            return 0  # the connector keeps no KV of this request for another instance to read
        sequence = getattr(request, "all_token_ids", None)
        tokens = np.asarray(list((request.prompt_token_ids if sequence is None else sequence) or []), dtype=np.int64)
        end = min(len(tokens), len(rows))
        publisher = store_publisher.for_engine()  # the engine's own (output feature's) ledger
        if publisher is not None:
            try:
                params[self.KEY_FIELD] = publisher.publish_rows(np.ascontiguousarray(rows[:end]), digest(tokens[:end]))
                return end
            except StoreError as error:  # carried in the parameters instead
                logger.warning("routed-experts store: a lent prompt's rows ride in kv_transfer_params: %s", error)
        buffer = io.BytesIO()
        _save(buffer, tokens[:end], rows[:end], self.layout)
        params[self.FIELD] = base64.b64encode(buffer.getvalue()).decode("ascii")
        params[self.MAC_FIELD] = self._mac(buffer.getvalue())
        return end

    def get(self, request: Any, start: int, count: int) -> np.ndarray | Missing:
        params = getattr(request, "kv_transfer_params", None) or {}
        if isinstance(params, dict) and self.KEY_FIELD in params:
            return self._from_store(request, str(params[self.KEY_FIELD]), start, count)
        payload = params.get(self.FIELD) if isinstance(params, dict) else None
        if payload is None:
            return Missing(
                f"its kv_transfer_params carry no routing rows (no '{self.FIELD}': the instance that computed the KV "
                "ran without vllm-ascend-routing or without --enable-return-routed-experts, or the proxy dropped them)"
            )
        try:
            raw = base64.b64decode(str(payload), validate=True)
        except (ValueError, binascii.Error) as error:
            return Missing(f"the routing rows in its kv_transfer_params cannot be read ({error})")
        if not hmac.compare_digest(str(params.get(self.MAC_FIELD, "")), self._mac(raw)):
            return Missing(
                "the routing rows in its kv_transfer_params are not signed by this deployment (altered on the way, or "
                "lent by an instance with another VLLM_ASCEND_ROUTING_KV_SECRET: set the same secret on the prefill "
                "and decode instances)"
            )
        try:
            tokens, rows = _read(io.BytesIO(raw), self.layout)
        except (OSError, ValueError, KeyError) as error:
            return Missing(f"the routing rows in its kv_transfer_params cannot be read ({error})")
        end = start + count
        prompt = np.asarray(list(request.prompt_token_ids or [])[:end], dtype=np.int64)
        if len(tokens) < end or len(prompt) < end or not np.array_equal(tokens[:end], prompt):
            return Missing(
                f"the routing rows in its kv_transfer_params are of other tokens than this prompt's first {end} "
                f"({len(tokens)} tokens carried)"
            )
        return np.ascontiguousarray(rows[start:end])

    def _from_store(self, request: Any, key: str, start: int, count: int) -> np.ndarray | Missing:
        return rows_from_store(request, key, start, count, self.layout, "its kv_transfer_params name")

    def settled(self, request: Any) -> None:
        """The load is decided (the rows put where vLLM reads them, or declined): stored ones are freed (one load
        per lent prompt)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        if isinstance(params, dict) and self.KEY_FIELD in params:
            release_quietly(str(params[self.KEY_FIELD]))


def rows_from_store(
    request: Any, key: str, start: int, count: int, layout: RowLayout, named: str
) -> np.ndarray | Missing:
    """The rows of the request's prompt tokens ``[start, start + count)`` stored under ``key`` by the instance that
    lent that KV, checked against this prompt's token ids (the digest stored beside them) and this engine's layout;
    ``named``: what named the key (for the reason)."""
    try:
        stored = store_reader.open_rows(key)
    except (StoreError, ValueError) as error:
        return Missing(f"the routing rows {named} cannot be read from the store: {error}")
    end = start + count
    prompt = np.asarray(list(request.prompt_token_ids or [])[: len(stored)], dtype=np.int64)
    if len(prompt) < len(stored) or digest(prompt) != stored.header.tokens_sha256 or len(stored) < end:
        return Missing(
            f"the routing rows {named} are of other tokens than this prompt's first {end} ({len(stored)} tokens stored)"
        )
    if (stored.dtype, stored.shape[1:]) != (np.dtype(layout.dtype), (layout.num_layers, layout.top_k)):
        return Missing(
            f"the stored rows are {stored.shape[1:]} {stored.dtype} per token, this engine's are "
            f"({layout.num_layers}, {layout.top_k}) {layout.dtype}: another model or configuration"
        )
    return np.ascontiguousarray(stored.window(start, end).read())


def release_quietly(key: str) -> None:
    """Free stored rows once loaded (a failure only leaves them to their TTL or their engine's exit)."""
    try:
        store_reader.release(key)
    except (StoreError, ValueError, OSError) as error:
        logger.warning("routed-experts store: freeing loaded rows %s failed (left to their TTL): %s", key, error)


def digest(tokens: np.ndarray) -> str:
    """The digest of token ids stored beside lent rows (``store.layout.Header.tokens_sha256``)."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int64).tobytes()).hexdigest()


@dataclass(frozen=True)
class _Held:
    """One held piece of a request's tokens: the token ids of one block (or of the last, partial block) and their
    rows; its key in the carrier names the block and every token before it."""

    tokens: np.ndarray
    rows: np.ndarray


class HeldRowsCarrier:
    """Rows of requests computed on this instance (their prompts', and their generated tokens' where the generation's
    store gives them), held in this scheduler's memory for a connector whose storage the plugin cannot write into.
    Keys chain SHA-256 over the token ids block by block (seeded with the model's other inputs: the LoRA adapter,
    multimodal inputs; a cache salt changes no row), so a block's rows are found only with every token before it the
    same; each held piece also keeps its token ids, compared again on reading.
    At most ``capacity`` bytes (rows and token ids); the least recently used pieces go first. ``clear`` drops all
    (vLLM's prefix cache reset: weights may have changed since the rows were computed)."""

    def __init__(self, connector: str, layout: RowLayout, block_size: int, capacity: int) -> None:
        self.connector = connector
        self.layout = layout
        self.block_size = int(block_size)
        self.capacity = int(capacity)
        self.held_bytes = 0
        self._held: OrderedDict[bytes, _Held] = OrderedDict()

    def _key(self, parent: bytes, tokens: np.ndarray) -> bytes:
        """The key of one piece (a whole block, or a shorter last one) after the piece keyed ``parent``."""
        tail = b"" if len(tokens) == self.block_size else b"partial"
        return hashlib.sha256(parent + tail + tokens.tobytes()).digest()

    def chain(self, request: Any, tokens: np.ndarray, end: int) -> list[tuple[bytes, bytes, int, int]]:
        """``(parent key, key, first, last)`` of each whole block of ``tokens[:end]``, then of its partial last
        block; the first parent is what else keys vLLM's KV of these tokens (``_kv_identity``)."""
        key = hashlib.sha256(repr(_kv_identity(request)).encode()).digest()
        pieces = []
        for first in range(0, end, self.block_size):
            last = min(first + self.block_size, end)
            parent, key = key, self._key(key, tokens[first:last])
            pieces.append((parent, key, first, last))
        return pieces

    def put(self, request: Any, rows: np.ndarray, finished: Any = None) -> int:
        # The generated tokens' rows too, where given: a later turn's prompt repeats them, and an offload tier
        # keeps their KV.
        sequence = getattr(request, "all_token_ids", None)
        tokens = np.asarray(list((request.prompt_token_ids if sequence is None else sequence) or []), dtype=np.int64)
        end = min(len(tokens), len(rows))
        stored = 0
        for _, key, first, last in self.chain(request, tokens, end):
            if key in self._held:
                self._held.move_to_end(key)
                continue
            piece = _Held(tokens[first:last].copy(), np.ascontiguousarray(rows[first:last]))
            self._held[key] = piece
            self.held_bytes += piece.tokens.nbytes + piece.rows.nbytes
            stored += last - first
        while self.held_bytes > self.capacity and self._held:
            _, dropped = self._held.popitem(last=False)
            self.held_bytes -= dropped.tokens.nbytes + dropped.rows.nbytes
        return stored

    def get(self, request: Any, start: int, count: int) -> np.ndarray | Missing:
        tokens = np.asarray(list(request.prompt_token_ids or []), dtype=np.int64)
        end = start + count
        if end > len(tokens):
            return Missing(f"the load reaches past the prompt ({end} of {len(tokens)} tokens): no rows are held there")
        rows = []
        for parent, key, first, last in self.chain(request, tokens, end):
            if last <= start:
                continue  # before the load: vLLM's own cache holds those tokens
            found = self._find(tokens, parent, key, first, last)
            if found is None:
                return Missing(
                    f"the rows of tokens [{first}, {last}) are not held on this instance (their KV was computed by "
                    "another instance, or before a prefix-cache reset, or they were dropped to stay within "
                    "VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB)"
                )
            self._held.move_to_end(found[0])
            rows.append(found[1].rows[max(start - first, 0) : last - first])
        return np.ascontiguousarray(np.concatenate(rows)) if rows else Missing("no tokens to load")

    def _find(self, tokens: np.ndarray, parent: bytes, key: bytes, first: int, last: int) -> tuple[bytes, _Held] | None:
        """The held piece with the rows of ``tokens[first:last]``: its own, or (the load ends inside a block) one
        held for this prompt's tokens past the load's end, in the same block."""
        candidates = [key] + [
            self._key(parent, tokens[first:longer])
            for longer in range(last + 1, min(first + self.block_size, len(tokens)) + 1)
        ]  # fmt: skip
        for candidate in candidates:
            piece = self._held.get(candidate)
            if piece is not None and np.array_equal(piece.tokens[: last - first], tokens[first:last]):
                return candidate, piece
        return None

    def clear(self) -> None:
        self._held.clear()
        self.held_bytes = 0


def _kv_identity(request: Any) -> tuple[Any, ...]:
    """What, besides the token ids, the model computes a request's routing from (vLLM's prefix cache also keys
    KV by a cache salt, which partitions the cache and changes no row: the connector decides whether salted KV
    is shared)."""
    lora = getattr(request, "lora_request", None)
    features = getattr(request, "mm_features", None) or []
    return (
        getattr(lora, "lora_name", None),
        tuple((str(f.identifier), repr(getattr(f, "mm_position", None))) for f in features),
    )


def _write(path: str, tokens: np.ndarray, rows: np.ndarray, layout: RowLayout) -> None:
    """Write atomically (a reader sees the whole file or none): a private temporary file, then a rename."""
    folder = os.path.dirname(path)
    descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=".vllm_ascend_routing_", suffix=".npz")
    try:
        with os.fdopen(descriptor, "wb") as file:
            _save(file, tokens, rows, layout)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _save(file: Any, tokens: np.ndarray, rows: np.ndarray, layout: RowLayout) -> None:
    np.savez(
        file,
        format=np.int64(_FORMAT),
        layout=np.array([layout.num_layers, layout.top_k], dtype=np.int64),
        dtype=np.array(layout.dtype),
        token_ids=tokens,
        rows=np.ascontiguousarray(rows),
    )


def _read(path: Any, layout: RowLayout) -> tuple[np.ndarray, np.ndarray]:
    """The token ids and rows of one stored ``.npz`` (a path or a file object), checked against ``layout``."""
    with np.load(path, allow_pickle=False) as stored:
        if int(stored["format"]) != _FORMAT:
            raise ValueError(f"format {int(stored['format'])}, this version reads {_FORMAT}")
        rows, tokens = stored["rows"], stored["token_ids"]
    if not layout.matches(rows):
        raise ValueError(
            f"rows {rows.shape[1:]} {rows.dtype.name} per token, this engine's are "
            f"({layout.num_layers}, {layout.top_k}) {layout.dtype}: stored by another model or configuration"
        )
    if len(rows) != len(tokens):
        raise ValueError(f"{len(rows)} rows for {len(tokens)} token ids")
    return tokens, rows
