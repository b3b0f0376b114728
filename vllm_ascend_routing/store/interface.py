# SPDX-License-Identifier: Apache-2.0
"""The one small interface every row-store backend implements (``shm``, ``mooncake``), and the errors a caller sees.

A backend stores opaque objects by key: ``put`` once, ``read`` any byte range, ``remove``. What an object holds (a
header and the rows, layer-major) is ``store.layout``'s; who may write, for how long and how much is
``store.ledger``'s. A leaf: imports nothing of the package.
"""

from __future__ import annotations

from typing import Protocol


class StoreError(RuntimeError):
    """A row store failed (full, unreachable, a malformed object)."""


class UnknownKeyError(StoreError, KeyError):
    """A key no live object answers: never minted, released, expired (TTL), or of an engine that has exited."""

    def __init__(self, key: str, why: str = "") -> None:
        self.key = key
        detail = f": {why}" if why else ""
        super().__init__(
            f"routed-experts key {key!r} resolves to no rows (unknown, released, expired or of an engine that has "
            f"exited){detail}"
        )

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class NothingStoredError(StoreError):
    """A name whose writer stored no rows under it (its store was full or failed), and says why: nothing will come."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason
        super().__init__(f"no rows were stored under {name!r}: {reason}")


class StoreFullError(StoreError):
    """Publishing would pass the byte cap (``VLLM_ASCEND_ROUTING_STORE_MIB``) or the backend has no room."""


class StoreUnavailableError(StoreError):
    """The store cannot be reached or used (refused at start-up; mid-run the rows go inline instead)."""


class Backend(Protocol):
    """One store backend. ``name`` is the setting's scheme (``shm``, ``mooncake``)."""

    name: str

    def put(self, key: str, parts: list[memoryview]) -> None:
        """Store the concatenation of ``parts`` under ``key`` (a fresh key: never overwrites).

        Raises:
            StoreFullError: no room. StoreUnavailableError: the store cannot be reached.
        """

    def put_new(self, items: list[tuple[str, bytes]]) -> list[str]:
        """Store each small object whose key is free, in as few round trips as the backend allows; a taken key is
        left as it is. The keys written.

        Raises:
            StoreUnavailableError: the store cannot be reached.
        """

    def read(self, key: str, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes of ``key``'s object from ``offset``.

        Raises:
            UnknownKeyError: no such object. StoreUnavailableError: the store cannot be reached.
        """

    def size(self, key: str) -> int | None:
        """The object's size in bytes, ``None`` where there is none."""

    def remove(self, key: str) -> bool:
        """Remove ``key``'s object; whether there was one."""

    def close(self) -> None:
        """Release what this client holds (a Mooncake segment: the objects put through it go with it)."""
