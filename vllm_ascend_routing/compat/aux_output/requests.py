# SPDX-License-Identifier: Apache-2.0
"""Per-request routed-experts options on vLLM 0.31+'s AuxOutput connector (generation ``aux-output``), scheduler side.

The scheduler-side connector tells the worker, per scheduled request, the first token whose rows it must emit
(``AuxOutputConnectorMetadata.requests``), computed from ``routed_experts_prompt_start`` when the metadata is built,
in ``schedule()``: before the scheduler's ``update_from_output`` of that step. So a request's first row is decided
here, on its first scheduling (``RequestSelection.first_scheduled``: the output feature's, ``output.engine``, handed
to the adapter at install), and an opted-out request's emit start is put
out of reach: its worker state still captures and publishes its blocks (other requests' prefix hits read them),
but never emits, materialises or ships a row of it; ``take_output`` then has nothing to take for it.

Except where the scheduler's rows follow a KV connector (``keep_prompt_rows``: ``aux_output/kv_rows.py``): there every
request's prompt rows travel with the KV its connector stores or lends (a P/D prefill's parameters, a stored prefix,
an offload tier), whichever rows its caller asked for. So the worker emits every request's rows from its first prompt
token (as with prompt start 0; later steps keep vLLM's start, the new token's), and the scheduler takes them: the rows
before the request's own first token are cut from what vLLM gets (``from_first_token``), and the output feature drops
an opted-out request's rows from its output, so each caller still gets what it asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_ascend_routing import patching
from vllm_ascend_routing.compat.interface import RequestSelection
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
_KEEPS = "_vllm_ascend_routing_keeps_prompt_rows"  # attribute of a scheduler-side AuxOutput connector


def keep_prompt_rows(connector: Any) -> None:
    """This scheduler's rows follow a KV connector: every request's prompt rows reach it, whatever its caller asked
    for (opted out, ``routed_experts_omit``, ``routed_experts_prompt_start``); each caller still gets only its own."""
    setattr(connector, _KEEPS, True)


def keeps_prompt_rows(connector: Any) -> bool:
    return bool(getattr(connector, _KEEPS, False))


def from_first_token(request: Any, token_start: int, rows: Any) -> Any:
    """Rows taken from token ``token_start`` on, cut to those from the request's own first token (the start its
    caller asked for, set on the request's parameters at its first scheduling: ``RequestSelection.first_scheduled``)."""
    params = getattr(request, "sampling_params", None)  # None: a pooling request
    first = min(int(getattr(params, "routed_experts_prompt_start", 0) or 0), int(request.num_prompt_tokens))
    return rows if rows is None or first <= token_start else rows[first - token_start :]


def install(selection: RequestSelection) -> None:
    patching.replace(BUILD_CONNECTOR_META, lambda method: _building(method, selection))
    patching.replace(TAKE_OUTPUT, lambda method: _taking(method, selection))


def _building(build_connector_meta: Callable[..., Any], selection: RequestSelection) -> Callable[..., Any]:
    @functools.wraps(build_connector_meta)
    def wrapper(self: Any, scheduler_output: Any, requests: Any, *args: Any, **kwargs: Any) -> Any:
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id in selection.selecting & scheduled.keys():
            selection.first_scheduled(requests[request_id])
        metadata = build_connector_meta(self, scheduler_output, requests, *args, **kwargs)
        if keeps_prompt_rows(self):
            # every prompt's rows from its first token; once it has output, vLLM's start (the new token's) stands
            for request_id in metadata.requests:
                if int(requests[request_id].num_output_tokens) == 0:
                    metadata.requests[request_id] = 0
            return metadata
        for request_id in selection.opted_out & metadata.requests.keys():
            metadata.requests[request_id] = NEVER
        return metadata

    return wrapper


def _taking(take_output: Callable[..., Any], selection: RequestSelection) -> Callable[..., Any]:
    @functools.wraps(take_output)
    def wrapper(self: Any, request: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
        if request.request_id in selection.opted_out and not keeps_prompt_rows(self):
            return None
        return take_output(self, request, output, *args, **kwargs)

    return wrapper
