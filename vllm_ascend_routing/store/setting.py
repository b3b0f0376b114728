# SPDX-License-Identifier: Apache-2.0
"""``VLLM_ASCEND_ROUTING_STORE``: which backend, found from the setting (as ``compat/`` finds a generation).

unset / ""                       rows inline (vLLM's own field), as without a store
shm                              store.shm: node-local shared memory, no service
mooncake://HOST:PORT?metadata=…  store.mooncake: Mooncake's distributed store (its master and metadata server)
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_ascend_routing import envs
from vllm_ascend_routing.store.interface import Backend

FORMS = "'shm' or 'mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata'"


@dataclass(frozen=True)
class Setting:
    scheme: str  # "shm" or "mooncake"
    value: str  # the setting as given


def current(value: str | None = None) -> Setting | None:
    """The setting (``value``, else the environment's); ``None``: rows inline. Raises ``ValueError`` naming the forms
    accepted for anything else."""
    text = (envs.VLLM_ASCEND_ROUTING_STORE if value is None else value).strip()
    if not text:
        return None
    if text == "shm":
        return Setting("shm", text)
    if text.startswith("mooncake://"):
        from vllm_ascend_routing.store import mooncake

        mooncake.parse_url(text)  # the message names what is wrong
        return Setting("mooncake", text)
    raise ValueError(f"VLLM_ASCEND_ROUTING_STORE={text!r}: expected {FORMS}, or unset for rows inline")


def probe(setting: Setting) -> None:
    """Whether the store can be used, cheaply (no object written, no segment mounted): at start-up, in every process.
    Raises ``StoreUnavailableError`` saying what to do."""
    if setting.scheme == "shm":
        from vllm_ascend_routing.store.shm import ShmBackend

        ShmBackend()
    else:
        from vllm_ascend_routing.store import mooncake

        mooncake.probe(mooncake.parse_url(setting.value))


def open_backend(setting: Setting, *, writer_bytes: int = 0) -> Backend:
    """A client of the store. ``writer_bytes``: the room a writer (an engine core) needs (a Mooncake writer mounts a
    segment that large, which holds the objects it puts while it lives)."""
    if setting.scheme == "shm":
        from vllm_ascend_routing.store.shm import ShmBackend

        return ShmBackend()
    from vllm_ascend_routing.store import mooncake

    return mooncake.MooncakeBackend(mooncake.parse_url(setting.value), segment_bytes=writer_bytes)
