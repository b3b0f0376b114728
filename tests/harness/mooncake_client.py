# SPDX-License-Identifier: Apache-2.0
"""A Mooncake store client in a process of its own, driven one JSON line at a time (``tests/store/test_mooncake.py``).

Run with the Mooncake kit's environment (``scripts/mooncake_kit.py``: ``PYTHONPATH``, ``LD_LIBRARY_PATH``), so the test
process never loads Mooncake: its libraries are found, a client crash or hang stays here, and each client owns its
segment as an engine core would. Requests ``{"op": ..., ...}`` on stdin, one answer line each on stdout:
``{"ok": true, ...}`` or ``{"ok": false, "error": CLASS, "message": ..., "key": ...}``. Arrays travel as ``.npy`` files.

    open url segment_bytes           MooncakeBackend(url, segment_bytes)
    probe url                        mooncake.probe(parse_url(url))
    put_rows key path first_token    layout.encode of the array at path, then put
    read_rows key path [layers] [start stop]  StoredRows of key (a window, some layers) saved to path; bytes read
    read key offset nbytes           raw ranged read: its length
    size key / remove key / close
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

from vllm_ascend_routing.store import keys, layout, mooncake
from vllm_ascend_routing.store.interface import UnknownKeyError


def loopback_rx_bytes() -> int:
    """Bytes received on the loopback interface (all processes here): what a ranged read really moved."""
    with open("/proc/net/dev") as stats:
        for line in stats:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[0])
    return 0


class Client:
    def __init__(self) -> None:
        self.backend: mooncake.MooncakeBackend | None = None

    def open(self, url: str, segment_bytes: int) -> dict[str, Any]:
        started = time.monotonic()
        self.backend = mooncake.MooncakeBackend(url, segment_bytes)
        return {"seconds": time.monotonic() - started, "segment_bytes": self.backend.segment_bytes}

    def probe(self, url: str) -> dict[str, Any]:
        mooncake.probe(mooncake.parse_url(url), timeout=2.0)
        return {}

    def put_rows(self, key: str, path: str, first_token: int) -> dict[str, Any]:
        assert self.backend is not None
        parts, _ = layout.encode(key, np.load(path), first_token)
        started = time.monotonic()
        self.backend.put(key, parts)
        return {"seconds": time.monotonic() - started, "bytes": sum(len(part) for part in parts)}

    def name(self, name: str, key: str) -> dict[str, Any]:
        """Put under ``name`` a pointer to ``key`` (what ``Ledger.name`` stores)."""
        assert self.backend is not None
        self.backend.put(name, layout.encode_pointer(name, key, keys.parse(key).instance))
        return {}

    def name_many(self, pairs: list[list[str]]) -> dict[str, Any]:
        """Pointers under each name to its key in one batch (what ``Ledger.name_many`` stores): the names written."""
        assert self.backend is not None
        items = [
            (name, b"".join(bytes(p) for p in layout.encode_pointer(name, key, keys.parse(key).instance)))
            for name, key in pairs
        ]
        return {"written": self.backend.put_new(items)}

    def resolve(self, name: str) -> dict[str, Any]:
        assert self.backend is not None
        return {"key": layout.read_pointer(self.backend, name).key}

    def read_rows(
        self, key: str, path: str, layers: list[int] | None = None, start: int | None = None, stop: int | None = None
    ) -> dict[str, Any]:
        assert self.backend is not None
        header, payload_at = layout.read_header(self.backend, key)
        rows = layout.StoredRows(self.backend, header, payload_at)
        if start is not None:
            rows = rows.window(start, len(rows) if stop is None else stop)
        before_bytes, before_wire, started = self.backend.bytes_read, loopback_rx_bytes(), time.monotonic()
        array = rows.read(layers)
        seconds, wire = time.monotonic() - started, loopback_rx_bytes() - before_wire
        np.save(path, array)
        return {
            "rows_bytes": rows.reads.bytes,
            "rows_calls": rows.reads.calls,
            "backend_bytes": self.backend.bytes_read - before_bytes,
            "wire_bytes": wire,
            "seconds": seconds,
        }

    def read(self, key: str, offset: int, nbytes: int) -> dict[str, Any]:
        assert self.backend is not None
        started = time.monotonic()
        data = self.backend.read(key, offset, nbytes)
        return {"length": len(data), "seconds": time.monotonic() - started}

    def size(self, key: str) -> dict[str, Any]:
        assert self.backend is not None
        return {"size": self.backend.size(key)}

    def remove(self, key: str) -> dict[str, Any]:
        assert self.backend is not None
        return {"removed": self.backend.remove(key)}

    def close(self) -> dict[str, Any]:
        if self.backend is not None:
            self.backend.close()
        return {}


def main() -> None:
    client = Client()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            answer: dict[str, Any] = {"ok": True, **getattr(client, op)(**request)}
        except Exception as error:  # every failure is the answer: the test asserts on it
            answer = {"ok": False, "error": type(error).__name__, "message": str(error)}
            if isinstance(error, UnknownKeyError):
                answer["key"] = error.key
        print(json.dumps(answer), flush=True)
        if op == "close":
            break
    sys.stdout.flush()
    os._exit(0)  # skip Mooncake's destructors: against a dead master they retry for ~20 s


if __name__ == "__main__":
    main()
