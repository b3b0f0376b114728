# SPDX-License-Identifier: Apache-2.0
"""Row-store keys: namespaced (engine instance, DP rank, engine start) and carrying an unguessable part.

    rx1.<instance>.dp<rank>.<start>.<secret>[@<rows>]

``instance`` is minted once per engine-core process, ``start`` is that process's start (ms since the epoch, hex),
``secret`` 128 random bits per object (``secrets``). A key of another engine, or of an earlier start of this one,
never names this start's objects: its namespace differs, and so does its secret. ``@<rows>``: the object's first
``rows`` rows only (the front end cuts a request's rows where its detokenizer dropped tokens past a stop string).

    rxn.<64 hex>

A *name*: what two instances that share nothing but a secret and an identifier derive alike (``derive``: HMAC-SHA256 of
the identifier under the deployment's secret), for rows whose key cannot travel with their KV (vLLM's
``MooncakeConnector`` passes a transfer id only). A name's object holds a key (``layout.encode_pointer``), never rows.
A leaf.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

VERSION = "rx1"
NAME_VERSION = "rxn"
_NAME = re.compile(r"^rxn\.[0-9a-f]{64}$")
_PATTERN = re.compile(
    r"^rx1\.(?P<instance>[0-9a-f]{8})\.dp(?P<dp>[0-9]{1,4})\.(?P<start>[0-9a-f]{1,16})\.(?P<secret>[0-9a-f]{32})"
    r"(?:@(?P<rows>[0-9]{1,12}))?$"
)


class MalformedKeyError(ValueError):
    """A string that is not a routed-experts store key."""

    def __init__(self, key: object) -> None:
        self.key = key
        super().__init__(
            f"{key!r} is not a routed-experts store key (expected rx1.<instance>.dp<rank>.<start>.<secret>, as "
            "routed_experts_info['store_key'] gives it)"
        )


@dataclass(frozen=True)
class Namespace:
    """One engine core's keys: its instance, DP rank and start."""

    instance: str
    dp_rank: int
    start: int

    @classmethod
    def mint(cls, dp_rank: int = 0) -> Namespace:
        return cls(secrets.token_hex(4), int(dp_rank), int(time.time() * 1000))

    def key(self) -> str:
        """A fresh key in this namespace (128 random bits)."""
        return f"{VERSION}.{self.instance}.dp{self.dp_rank}.{self.start:x}.{secrets.token_hex(16)}"


@dataclass(frozen=True)
class Key:
    """A parsed key: the object's name (``object``, without ``@rows``) and the rows it asks for."""

    object: str
    instance: str
    dp_rank: int
    start: int
    secret: str
    rows: int | None  # None: every row of the object

    def with_rows(self, rows: int) -> str:
        return f"{self.object}@{rows}"


def parse(key: object) -> Key:
    """Raises ``MalformedKeyError`` for anything that is not a key this project mints."""
    match = _PATTERN.match(key) if isinstance(key, str) else None
    if match is None:
        raise MalformedKeyError(key)
    rows = match.group("rows")
    return Key(
        match.string.split("@", 1)[0],
        match.group("instance"),
        int(match.group("dp")),
        int(match.group("start"), 16),
        match.group("secret"),
        None if rows is None else int(rows),
    )


def derive(secret: bytes, scope: str, identifier: str) -> str:
    """The name both ends derive for ``identifier`` in ``scope`` (``rxn.<64 hex>``): without ``secret`` nobody can
    plant an object under it, nor tell whose transfer it names."""
    digest = hmac.new(secret, f"{scope}\0{identifier}".encode(), hashlib.sha256).hexdigest()
    return f"{NAME_VERSION}.{digest}"


def is_name(text: object) -> bool:
    return isinstance(text, str) and _NAME.match(text) is not None


def object_of(text: object) -> str:
    """The stored object a key (its ``@rows`` dropped) or a name stands for. Raises ``MalformedKeyError``."""
    return str(text) if is_name(text) else parse(text).object
