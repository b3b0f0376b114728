# SPDX-License-Identifier: Apache-2.0
"""Rows behind keys (an engine with ``VLLM_ASCEND_ROUTING_STORE`` set: ``routed_experts_info["store_key"]``), read by
whoever holds a key: a trainer (``replay.fetch``, ``replay.open_rows``, ``replay.release``), or a decode instance
loading a P/D prefill's rows (``kv.carriers``).

    rows = fetch(info["store_key"])               # exactly the array the request would have returned inline
    lazy = open_rows(info["store_key"])           # nothing read yet: align(lazy, ...) / to_megatron read a slice
    release(keys)                                 # free them once every rank has read its slice
    key = resolve(name)                           # the key a name (keys.derive) points to (P/D by transfer id)

The store is the one the environment names (``VLLM_ASCEND_ROUTING_STORE``, as the engines were started with), or the
``store=`` given. NumPy only (and the store's client), never vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import overload

import numpy as np

from vllm_ascend_routing.store import keys, layout
from vllm_ascend_routing.store import setting as store_setting
from vllm_ascend_routing.store.interface import Backend, NothingStoredError, UnknownKeyError

_clients: dict[str, Backend] = {}


def client(store: str | None = None) -> Backend:
    """This process's reader of ``store`` (a ``VLLM_ASCEND_ROUTING_STORE`` value; ``None``: the environment's)."""
    found = store_setting.current(store)
    if found is None:
        raise ValueError(
            "no row store: set VLLM_ASCEND_ROUTING_STORE as the engines had it (or pass store=...) to fetch keys"
        )
    if found.value not in _clients:
        _clients[found.value] = store_setting.open_backend(found)
    return _clients[found.value]


def open_rows(key: str, *, store: str | None = None) -> layout.StoredRows:
    """``key``'s rows, lazily (``layout.StoredRows``): only the header is read.

    Raises:
        MalformedKeyError: not a key. UnknownKeyError: unknown, released, expired, or of an exited engine.
    """
    parsed = keys.parse(key)
    backend = client(store)
    header, payload_at = layout.read_header(backend, parsed.object)
    if header.key != parsed.object:  # never another key's rows, whatever the backend's naming
        raise UnknownKeyError(key, f"the object found holds {header.key!r}")
    rows = layout.StoredRows(backend, header, payload_at)
    if parsed.rows is not None:
        if parsed.rows > len(rows):
            raise UnknownKeyError(key, f"asks for {parsed.rows} rows of an object of {len(rows)}")
        rows = rows.window(0, parsed.rows)
    return rows


@overload
def fetch(key: str, *, store: str | None = None) -> np.ndarray: ...  # type: ignore[overload-overlap]
@overload
def fetch(key: Iterable[str], *, store: str | None = None) -> list[np.ndarray]: ...
def fetch(key: str | Iterable[str], *, store: str | None = None) -> np.ndarray | list[np.ndarray]:
    """The array (or arrays, for several keys) the request would have returned inline: its dtype, its shape, row
    ``i`` the token ``routed_experts_info["first_token"] + i``."""
    if isinstance(key, str):
        return np.asarray(open_rows(key, store=store))
    return [np.asarray(open_rows(one, store=store)) for one in key]


def release(keys_: str | Iterable[str], *, store: str | None = None) -> int:
    """Free the keys' objects (each once, by whichever process is done with them last); how many were still there."""
    backend = client(store)
    items = [keys_] if isinstance(keys_, str) else list(keys_)
    return sum(backend.remove(keys.object_of(key)) for key in items)


def resolve(name: str, *, store: str | None = None) -> str:
    """The key a name (``keys.derive``) points to. Raises ``UnknownKeyError`` where nothing is stored under it (not yet,
    or no longer), ``NothingStoredError`` where its writer stored no rows (and says why), ``StoreError`` where what is
    stored there is not a pointer to that name."""
    if not keys.is_name(name):
        raise keys.MalformedKeyError(name)
    pointer = layout.read_pointer(client(store), name)
    if pointer.key is None:
        raise NothingStoredError(name, pointer.reason)
    return pointer.key
