# SPDX-License-Identifier: Apache-2.0
"""What one stored object holds, and the lazy reader a trainer rank slices without reading the rest.

    b"RXROWS01" | u32 header length | header (JSON) | padding to 64 bytes | rows, layer-major [L, T, K]

The header names the object's key (a reader checks it: a backend's name clash can never hand over another key's
rows), the array's dtype and shape ``[T, L, K]`` as vLLM returns it inline, and ``first_token`` (row ``i`` is token
``first_token + i``). Rows are stored layer-major: one pipeline stage's layers are one contiguous run each, and a
context-parallel chunk of tokens within a layer is one run too, so a rank reads its slice in a few ranged reads
(``StoredRows.read``).

A name's object (``keys.derive``) is a pointer, ``b"RXNAME01" | u32 length | JSON {name, key}``: the reader checks
that it names the name asked, then reads the key's object as any other. A leaf beside ``interface``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_ascend_routing.store.interface import Backend, StoreError, UnknownKeyError

MAGIC = b"RXROWS01"
POINTER_MAGIC = b"RXNAME01"
_POINTER_MAX = 4096  # a name's object holds one key: anything longer is not one of ours
_ALIGN = 64
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class Header:
    key: str  # the object's key (without ``@rows``)
    dtype: str
    shape: tuple[int, int, int]  # [T, L, K] as vLLM returns the array
    first_token: int
    tokens_sha256: str = ""  # P/D rows: the digest of the token ids they belong to (written by the engine)

    @property
    def payload_bytes(self) -> int:
        t, layers, k = self.shape
        return t * layers * k * np.dtype(self.dtype).itemsize


def encode(key: str, rows: np.ndarray, first_token: int, tokens_sha256: str = "") -> tuple[list[memoryview], Header]:
    """The object's bytes for ``rows`` (``[T, L, K]``), as parts for ``Backend.put`` (one copy: the layer-major
    transpose), and its header."""
    if rows.ndim != 3:
        raise ValueError(f"rows of shape {rows.shape}: expected [tokens, num_layers, top_k]")
    shape = (int(rows.shape[0]), int(rows.shape[1]), int(rows.shape[2]))
    header = Header(key, rows.dtype.str, shape, first_token, tokens_sha256)
    fields = {"key": key, "dtype": header.dtype, "shape": list(shape), "first_token": int(first_token)}
    text = json.dumps({**fields, "tokens_sha256": tokens_sha256} if tokens_sha256 else fields).encode()
    head = MAGIC + _LENGTH.pack(len(text)) + text
    head += b"\0" * (-len(head) % _ALIGN)
    payload = swap_axes(rows)
    return [memoryview(head), memoryview(payload.data).cast("B")], header


def swap_axes(block: np.ndarray) -> np.ndarray:
    """``[A, B, K]`` -> a contiguous ``[B, A, K]``, each row of ``K`` ids moved as one unit (a void item): about five
    times a plain transpose's speed here (16 MB in 9 ms, not 46), which keeps the engine core's publish short."""
    block = np.ascontiguousarray(block)
    a, b, k = block.shape
    unit = np.dtype((np.void, k * block.dtype.itemsize))
    swapped = np.ascontiguousarray(block.view(unit).reshape(a, b).T)
    return swapped.view(block.dtype).reshape(b, a, k)


def payload_offset(header_bytes: int) -> int:
    return header_bytes + (-header_bytes % _ALIGN)


def read_header(backend: Backend, key: str) -> tuple[Header, int]:
    """The header of ``key``'s object and where its rows start. Raises ``UnknownKeyError`` (from the backend)."""
    start = backend.read(key, 0, len(MAGIC) + _LENGTH.size)
    if start[: len(MAGIC)] != MAGIC:
        raise StoreError(f"the object of {key!r} is not a routed-experts object (bad magic)")
    (length,) = _LENGTH.unpack(start[len(MAGIC) :])
    fields = json.loads(backend.read(key, len(start), length))
    shape = tuple(fields["shape"])
    header = Header(fields["key"], fields["dtype"], shape, int(fields["first_token"]), fields.get("tokens_sha256", ""))  # type: ignore[arg-type]
    return header, payload_offset(len(start) + length)


@dataclass(frozen=True)
class Pointer:
    """What a name's object says: the key its rows are stored under, or (``key`` ``None``) that none were stored, and
    why. ``instance``: the writing engine's, whose lifetime the name shares."""

    key: str | None
    instance: str
    reason: str = ""


def encode_pointer(name: str, key: str | None, instance: str, reason: str = "") -> list[memoryview]:
    """The object stored under ``name``: ``key``, which the rows are stored under (``None``: none were, ``reason``)."""
    fields = {"name": name, "key": key, "instance": instance, **({"reason": reason} if key is None else {})}
    text = json.dumps(fields).encode()
    return [memoryview(POINTER_MAGIC + _LENGTH.pack(len(text)) + text)]


def decode_pointer(name: str, raw: bytes) -> Pointer:
    """``raw`` as the pointer stored under ``name``. Raises ``StoreError`` (not a pointer to that name)."""
    head = len(POINTER_MAGIC) + _LENGTH.size
    if len(raw) <= head or raw[: len(POINTER_MAGIC)] != POINTER_MAGIC:
        raise StoreError(f"the object of {name!r} is not a routed-experts pointer (bad magic or length)")
    (length,) = _LENGTH.unpack(raw[len(POINTER_MAGIC) : head])
    if head + length != len(raw):
        raise StoreError(f"the object of {name!r} is not a routed-experts pointer (bad length)")
    fields = json.loads(raw[head:])
    if not isinstance(fields, dict) or fields.get("name") != name:
        raise StoreError(f"the object of {name!r} points for another name ({fields!r:.120})")
    key, instance, reason = fields.get("key"), fields.get("instance"), fields.get("reason", "")
    if not (key is None or isinstance(key, str)) or not isinstance(instance, str) or not isinstance(reason, str):
        raise StoreError(f"the object of {name!r} is not a routed-experts pointer ({fields!r:.120})")
    return Pointer(key, instance, reason)


def read_pointer(backend: Backend, name: str) -> Pointer:
    """What ``name``'s object says. Raises ``UnknownKeyError`` (no such name: not yet, or no longer, stored) and
    ``StoreError`` (an object that is not a pointer to that name)."""
    size = backend.size(name)
    if size is None:
        raise UnknownKeyError(name)
    if size > _POINTER_MAX:
        raise StoreError(f"the object of {name!r} is not a routed-experts pointer ({size} bytes)")
    return decode_pointer(name, backend.read(name, 0, size))


class Reads:
    """Bytes and ranged reads a reader made (the benchmark's and the tests' measure of "only its slice")."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0


class StoredRows:
    """A stored request's rows as a lazy ``[rows, num_layers, top_k]`` array: nothing is read until asked.

    Slicing tokens (``rows[a:b]``) gives another lazy window; ``rows[:, layer]`` reads that layer's rows of the
    window (one ranged read); ``read(layers)`` reads several layers of the window (one read per layer);
    ``np.asarray(rows)`` reads all of it. ``reads`` counts what was read through this object and its windows.
    """

    ndim = 3

    def __init__(
        self,
        backend: Backend,
        header: Header,
        payload_at: int,
        start: int = 0,
        stop: int | None = None,
        reads: Reads | None = None,
    ) -> None:
        self._backend, self.header, self._payload_at = backend, header, payload_at
        self._start = start
        self._stop = header.shape[0] if stop is None else stop
        self.reads = reads or Reads()

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(self.header.dtype)

    @property
    def shape(self) -> tuple[int, int, int]:
        _, layers, k = self.header.shape
        return (self._stop - self._start, layers, k)

    @property
    def nbytes(self) -> int:
        rows, layers, k = self.shape
        return rows * layers * k * self.dtype.itemsize

    @property
    def first_token(self) -> int:
        return self.header.first_token + self._start

    def __len__(self) -> int:
        return self._stop - self._start

    def window(self, start: int, stop: int) -> StoredRows:
        """Rows ``start..stop-1`` of this window, lazily."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"rows {start}:{stop} outside the {len(self)} stored rows")
        return StoredRows(
            self._backend, self.header, self._payload_at, self._start + start, self._start + stop, self.reads
        )

    def read(self, layers: Sequence[int] | None = None) -> np.ndarray:
        """``[rows, len(layers), top_k]`` of this window (every layer for ``None``): one ranged read per layer."""
        total, num_layers, k = self.header.shape
        chosen = range(num_layers) if layers is None else list(layers)
        row_bytes = k * self.dtype.itemsize
        if list(chosen) == list(range(num_layers)) and len(self) == total and total:  # the whole object: one read
            data = self._backend.read(self.header.key, self._payload_at, num_layers * total * row_bytes)
            self.reads.bytes += len(data)
            self.reads.calls += 1
            return swap_axes(np.frombuffer(data, dtype=self.dtype).reshape(num_layers, total, k))
        out = np.empty((len(chosen), len(self), k), dtype=self.dtype)
        for j, layer in enumerate(chosen):
            if not 0 <= layer < num_layers:
                raise IndexError(f"layer {layer} outside the {num_layers} stored layers")
            if not len(self):
                continue
            at = self._payload_at + (layer * total + self._start) * row_bytes
            data = self._backend.read(self.header.key, at, len(self) * row_bytes)
            self.reads.bytes += len(data)
            self.reads.calls += 1
            out[j] = np.frombuffer(data, dtype=self.dtype).reshape(len(self), k)
        return swap_axes(out)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        rows = np.ascontiguousarray(self.read())
        return rows if dtype is None else rows.astype(dtype)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("stored rows are sliced with step 1")
            return self.window(start, max(start, stop))
        if (
            isinstance(index, tuple)
            and len(index) == 2
            and isinstance(index[0], slice)
            and index[0] == slice(None)
            and isinstance(index[1], int | np.integer)
        ):
            return self.read([int(index[1])])[:, 0]
        return np.asarray(self)[index]

    def __repr__(self) -> str:
        return f"StoredRows({self.header.key!r}, rows {self._start}:{self._stop} of {self.header.shape}, {self.dtype})"
