# SPDX-License-Identifier: Apache-2.0
"""Per-request routed-experts options on vLLM 0.31+'s AuxOutput connector (generation ``aux-output``), scheduler side.

The scheduler-side connector tells the worker, per scheduled request, the first token whose rows it must emit
(``AuxOutputConnectorMetadata.requests``), computed from ``routed_experts_prompt_start`` when the metadata is built,
in ``schedule()``: before the scheduler's ``update_from_output`` of that step. So a request's first row is decided
here, on its first scheduling (``output.engine.first_scheduled``), and an opted-out request's emit start is put
out of reach: its worker state still captures and publishes its blocks (other requests' prefix hits read them),
but never emits, materialises or ships a row of it; ``take_output`` then has nothing to take for it.

Except where the scheduler's rows follow a KV connector (``keep_opted_out_rows``: ``compat/_kv_aux.py``): there an
opted-out request's rows travel with the KV its connector stores or lends (a P/D prefill's parameters, a stored
prefix, an offload tier), so the worker emits them as for any request (its emit start as with prompt start 0) and
the scheduler takes them; ``output.engine`` drops them from the request's output, so the caller still gets none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_ascend_routing import patching
from vllm_ascend_routing.output import engine
from vllm_ascend_routing.patching import Patch
from vllm_ascend_routing.releases import Generation

_CONNECTOR = "vllm.distributed.aux_output_connector.connector:AuxOutputSchedulerConnector"
_KEEP = "never while per-request routed-experts options exist"
BUILD_CONNECTOR_META = Patch(
    f"{_CONNECTOR}.build_connector_meta",
    "a request's first row decided before the worker's emit start is computed; opted-out requests never emit",
    _KEEP,
    (Generation.AUX_OUTPUT,),
    ("self", "scheduler_output", "requests"),
)
TAKE_OUTPUT = Patch(
    f"{_CONNECTOR}.take_output",
    "an opted-out request has no rows to take",
    _KEEP,
    (Generation.AUX_OUTPUT,),
    ("self", "request", "output"),
)
PATCHES = (BUILD_CONNECTOR_META, TAKE_OUTPUT)
NEVER = 2**62  # an emit start no request reaches: the worker emits no row for it
_KEEPS = "_vllm_ascend_routing_keeps_opted_out_rows"  # attribute of a scheduler-side AuxOutput connector


def keep_opted_out_rows(connector: Any) -> None:
    """This scheduler's rows follow a KV connector: its opted-out requests' rows still reach it (never the caller)."""
    setattr(connector, _KEEPS, True)


def keeps_opted_out_rows(connector: Any) -> bool:
    return bool(getattr(connector, _KEEPS, False))


def _emit_start(request: Any) -> int:
    """vLLM's emit start for a request whose rows start at token 0: its prompt's first, then each new token's."""
    return 0 if int(request.num_output_tokens) == 0 else int(request.num_tokens) - 1


def install() -> None:
    patching.replace(BUILD_CONNECTOR_META, _building)
    patching.replace(TAKE_OUTPUT, _taking)


def _building(build_connector_meta: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(build_connector_meta)
    def wrapper(self: Any, scheduler_output: Any, requests: Any, *args: Any, **kwargs: Any) -> Any:
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id in engine.selecting & scheduled.keys():
            engine.first_scheduled(requests[request_id])
        metadata = build_connector_meta(self, scheduler_output, requests, *args, **kwargs)
        keeps = keeps_opted_out_rows(self)
        for request_id in engine.opted_out & metadata.requests.keys():
            metadata.requests[request_id] = _emit_start(requests[request_id]) if keeps else NEVER
        return metadata

    return wrapper


def _taking(take_output: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(take_output)
    def wrapper(self: Any, request: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
        if request.request_id in engine.opted_out and not keeps_opted_out_rows(self):
            return None
        return take_output(self, request, output, *args, **kwargs)

    return wrapper
