# SPDX-License-Identifier: Apache-2.0
"""The row store: finished requests' rows published once by the engine core, only a key in the output
(``routed_experts_info["store_key"]``), fetched by the trainer ranks slice by slice (``replay.fetch``, ``replay.open``).

  * ``setting``: ``VLLM_ASCEND_ROUTING_STORE`` → a backend (``shm``, ``mooncake``), the start-up probe;
  * ``interface``: the one small interface of a backend, and the errors;
  * ``keys``: namespaced, unguessable keys; ``layout``: what an object holds, and the lazy reader of a slice;
  * ``ledger``: the engine's objects within the byte cap and TTL; ``publisher``: the engine core's hand-off.

The feature surface the registry reads (``features.FEATURES``): the start-up check only; the publishing runs in the
output feature's scheduler hooks (``output.engine``), which exist where requests' rows are per request (0.22+).
"""

from __future__ import annotations

from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.patching import Patch
from vllm_ascend_routing.store import setting
from vllm_ascend_routing.store.interface import StoreError, StoreFullError, StoreUnavailableError, UnknownKeyError
from vllm_ascend_routing.store.keys import MalformedKeyError

__all__ = [
    "NEEDS",
    "PATCHES",
    "MalformedKeyError",
    "StoreError",
    "StoreFullError",
    "StoreUnavailableError",
    "UnknownKeyError",
    "install",
]

PATCHES: tuple[Patch, ...] = ()  # publishing rides on the output feature's scheduler rows
NEEDS: tuple[str, ...] = ()  # checked on every generation: refused by name where unserved
_checked: set[str] = set()


def install(ctx: InstallContext) -> None:
    """At start-up, in every process: refuse a store this vLLM cannot serve or that cannot be reached, saying what to
    do (once per setting and process)."""
    found = setting.current()
    if found is None or found.value in _checked:
        return
    if not ctx.adapter.per_request_output:
        raise UnsupportedVllmError(
            f"VLLM_ASCEND_ROUTING_STORE={found.value!r}: the row store needs vLLM 0.22 or later; vLLM {ctx.vllm}'s "
            f"routed-experts transport ({ctx.adapter.generation.value}) returns every request's rows through its own "
            "channel, which the plugin does not redirect. Unset VLLM_ASCEND_ROUTING_STORE (rows inline) or upgrade vLLM"
        )
    try:
        setting.probe(found)
    except StoreError as error:
        raise UnsupportedVllmError(f"VLLM_ASCEND_ROUTING_STORE={found.value!r} cannot be used: {error}") from error
    _checked.add(found.value)
