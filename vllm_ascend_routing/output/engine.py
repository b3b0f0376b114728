# SPDX-License-Identifier: Apache-2.0
"""The engine core's side of the per-request options and of the provenance record (vLLM 0.22+).

In the scheduler, for engines that return routed experts:
  * ``add_request``: the request's options (``output.options``) are read once;
  * ``update_from_output``: the step's weight version is taken from its ``ModelRunnerOutput``
    (``output.weights``); each request scheduled for the first time gets its bookkeeping (the prompt tokens
    served from the local prefix cache, the version of its first forward) and its first row decided
    (``select``): ``routed_experts_prompt_start`` on the engine core's copy of its sampling parameters, which is
    where vLLM's own transport starts the rows (0.22-0.30: the slot-buffer read at prefill completion; 0.31+:
    the AuxOutput connector's emit start). An opted-out request's first row is its last prompt token's, so vLLM
    reads one prompt row for it (not the prompt's), and its rows never leave this process (dropped from its outputs);
  * ``_free_request``: a finished request's record (first row, cached rows, rows a KV connector loaded as
    ``kv`` followed them (P/D hand-over), weight versions) goes to
    the front end with its last output, under ``RECORD_KEY`` in ``kv_transfer_params``, which the front end
    removes again (``output.frontend``): vLLM's array is never touched;
  * ``reset_prefix_cache``: rows served from the prefix cache afterwards were computed at or after the next
    step's version (``cached_from``).

The generation modules add what their transport needs on top (``compat/_aux_requests.py``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_ascend_routing import envs, kv, patching, validate
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.compat._requests import local_cached_tokens
from vllm_ascend_routing.output import options, weights
from vllm_ascend_routing.patching import Patch
from vllm_ascend_routing.store import publisher as store_publisher

logger = get_logger(__name__)

RECORD_KEY = "vllm_ascend_routing.routed_experts_info"  # in an output's kv_transfer_params, engine -> front end
_NEEDS = "per_request_output"  # the adapter capability every row here needs
_KEEP = "never while per-request routed-experts options exist"
_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
ADD_REQUEST = Patch(
    f"{_SCHEDULER}.add_request",
    "read a request's routed-experts options once",
    _KEEP,
    params=("self", "request"),
    needs=_NEEDS,
)
UPDATE_FROM_OUTPUT = Patch(
    f"{_SCHEDULER}.update_from_output",
    "the step's weight version; a new request's first row; opted-out rows dropped; records to the front end",
    _KEEP,
    params=("self", "scheduler_output", "model_runner_output"),
    needs=_NEEDS,
)
FREE_REQUEST = Patch(
    f"{_SCHEDULER}._free_request",
    "a finished request's provenance record",
    _KEEP,
    params=("self", "request"),
    needs=_NEEDS,
)
RESET_PREFIX_CACHE = Patch(
    f"{_SCHEDULER}.reset_prefix_cache",
    "rows cached from now on are of a newer version",
    _KEEP,
    params=("self",),
    needs=_NEEDS,
)
PATCHES = (ADD_REQUEST, UPDATE_FROM_OUTPUT, FREE_REQUEST, RESET_PREFIX_CACHE)

Requested = Callable[[Any], bool]  # whether an engine (its vllm_config) returns routed experts

_REQUEST = "_vllm_ascend_routing_output"  # engine-core Request attribute: its RequestState
_SCHEDULER_STATE = "_vllm_ascend_routing_output"  # Scheduler attribute: its EngineState
_UNSET = object()

# Requests (by id) whose first row this engine moves or whose rows it drops, and those opted out: the generation
# modules' scheduler-side hooks act on these only (``SELECTION``, handed to the adapter at install).
selecting: set[str] = set()
opted_out: set[str] = set()
inline: set[str] = set()  # on a store engine: requests that asked for their rows inline (routed_experts_transport)


@dataclass
class RequestState:
    """What the engine core keeps per request for its options and its record."""

    options: options.RequestOptions = options.NONE
    scheduled: bool = False
    cached: int = 0  # prompt tokens served from the local prefix cache at the first scheduling
    first_token: int | None = None  # the token of the first row, once decided (``select``)
    first_version: Any = _UNSET  # the weight version of the request's first forward


@dataclass
class EngineState:
    """Per scheduler: whether it returns routed experts, the current step's weight version, pending records."""

    enabled: bool
    version: int | None = None
    cached_from: int | None = None  # rows cached since the last prefix-cache reset: computed at this version or later
    cached_from_pending: bool = True
    updating: bool = False
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)  # opted-out requests that finished in this update
    publisher: store_publisher.Publisher | None = None  # VLLM_ASCEND_ROUTING_STORE set: rows published, keys sent
    violations: Callable[[str, Any], list[Any]] | None = None  # validation mode, on a store engine: checked here

    def step(self, version: int | None) -> None:
        self.version = version
        if self.cached_from_pending:
            self.cached_from, self.cached_from_pending = version, False


def install(requested: Requested) -> None:
    """Patch the scheduler (idempotent). ``requested(vllm_config)``: whether an engine returns routed experts (the
    adapter's ``routed_experts_requested``)."""
    patching.replace(ADD_REQUEST, lambda method: _adding(method, requested))
    patching.replace(UPDATE_FROM_OUTPUT, lambda method: _updating(method, requested))
    patching.replace(FREE_REQUEST, lambda method: _freeing(method, requested))
    patching.replace(RESET_PREFIX_CACHE, lambda method: _resetting(method, requested))


def state_of(request: Any) -> RequestState:
    state: RequestState | None = getattr(request, _REQUEST, None)
    if state is None:
        state = RequestState()
        setattr(request, _REQUEST, state)
    return state


def first_scheduled(request: Any) -> int:
    """At the request's first scheduling (idempotent): note the prompt tokens the local prefix cache served, then
    decide its first row (``select``); returns that token."""
    state = state_of(request)
    if not state.scheduled:
        state.scheduled = True
        state.cached = local_cached_tokens(request)
    return select(request, state)


def select(request: Any, state: RequestState) -> int:
    """The token of the request's first row: ``routed_experts_prompt_start``, moved past the prompt for an opted-out
    request and past the prefix-cached tokens for ``routed_experts_omit="cached"``. Where it moves, the engine core's
    request gets its own copy of the sampling parameters with that start (vLLM's transport reads it there)."""
    if state.first_token is not None:
        return state.first_token
    params = request.sampling_params
    start = int(getattr(params, "routed_experts_prompt_start", 0) or 0)
    last = int(request.num_prompt_tokens) - 1  # the latest start every 0.22+ scheduler takes (0.22-0.27 assert it)
    if state.options.opted_out:
        start = last  # one prompt row is read (the last prompt token's), dropped with the rest (``_finish``)
    elif state.options.omit_cached:
        start = max(start, min(state.cached, last))
    if start != int(params.routed_experts_prompt_start or 0):
        params = copy.copy(params)  # never the front end's object (in-process engines share it) nor a sibling's
        params.routed_experts_prompt_start = start
        request.sampling_params = params
    state.first_token = start
    return start


class _Selection:
    """This process's per-request choices, as the adapter's scheduler-side hooks read them
    (``compat.base.RequestSelection``)."""

    @property
    def selecting(self) -> set[str]:
        return selecting

    @property
    def opted_out(self) -> set[str]:
        return opted_out

    def first_scheduled(self, request: Any) -> int:
        return first_scheduled(request)


SELECTION = _Selection()


def _engine_state(scheduler: Any, requested: Requested) -> EngineState:
    state: EngineState | None = getattr(scheduler, _SCHEDULER_STATE, None)
    if state is None:
        state = EngineState(requested(scheduler.vllm_config))
        if state.enabled:
            dp_rank = int(getattr(scheduler.vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
            state.publisher = store_publisher.for_engine(dp_rank)
            if state.publisher is not None and envs.VLLM_ASCEND_ROUTING_VALIDATE != "off":
                model = validate.ModelRouting.from_vllm_config(scheduler.vllm_config)
                state.violations = functools.partial(_violations, model=model)
        setattr(scheduler, _SCHEDULER_STATE, state)
    return state


def _adding(add_request: Callable[..., Any], requested: Requested) -> Callable[..., Any]:
    @functools.wraps(add_request)
    def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if _engine_state(self, requested).enabled and getattr(request, "sampling_params", None) is not None:
            try:
                found = options.of(request.sampling_params)
            except options.RequestOptionError as error:  # the front end refuses these; a front end without it
                logger.error("request %s: %s; its routed experts are returned as usual", request.request_id, error)
                found = options.NONE
            if found is not options.NONE:
                state_of(request).options = found
                if found.selects_rows:
                    selecting.add(request.request_id)
                if found.opted_out:
                    opted_out.add(request.request_id)
                if found.inline:
                    inline.add(request.request_id)
        return add_request(self, request, *args, **kwargs)

    return wrapper


def _updating(update_from_output: Callable[..., Any], requested: Requested) -> Callable[..., Any]:
    @functools.wraps(update_from_output)
    def wrapper(self: Any, scheduler_output: Any, model_runner_output: Any, *args: Any, **kwargs: Any) -> Any:
        state = _engine_state(self, requested)
        if not state.enabled:
            return update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs)
        version = getattr(model_runner_output, weights.VERSION, None)
        state.step(version)
        for new in scheduler_output.scheduled_new_reqs:  # first (or resumed) scheduling: before vLLM reads the rows
            request = self.requests.get(new.req_id)
            if request is not None:
                first_scheduled(request)
                request_state = state_of(request)
                if request_state.first_version is _UNSET:
                    request_state.first_version = version
        state.updating = True
        try:
            outputs = update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs)
        finally:
            state.updating = False
        if state.records or state.dropped or opted_out or state.publisher is not None:
            _finish(outputs, state)
        return outputs

    return wrapper


def _finish(outputs: dict[int, Any], state: EngineState) -> None:
    """Drop opted-out requests' rows from this step's outputs; on a store engine hold the others' (``store.publisher``)
    and publish them at their last output; send finished requests' records with them."""
    publisher = state.publisher
    for engine_outputs in outputs.values():
        for output in engine_outputs.outputs:
            request_id = output.request_id
            if request_id in opted_out or request_id in state.dropped:
                output.routed_experts = None
            elif publisher is not None and request_id not in inline and output.routed_experts is not None:
                publisher.hold(request_id, output.routed_experts)  # only the key leaves this process
                output.routed_experts = None
            record = state.records.pop(request_id, None)
            if record is not None:
                if publisher is not None and request_id not in inline:
                    strict = envs.VLLM_ASCEND_ROUTING_VALIDATE == "strict"
                    fields, rows = publisher.publish(request_id, int(record["first_token"]), state.violations, strict)
                    record.update(fields)
                    if rows is not None:  # the store refused them: inline, and the record says why
                        output.routed_experts = rows
                inline.discard(request_id)
                output.kv_transfer_params = {**(output.kv_transfer_params or {}), RECORD_KEY: record}
    state.records.clear()
    state.dropped.clear()


def _violations(request_id: str, rows: Any, model: validate.ModelRouting) -> list[Any]:
    """Validation mode's rules on a request's whole array before it is stored (its row count is the rows it has)."""
    found = validate.check(rows, request_id=request_id, expected_rows=len(rows), model=model)
    for violation in found:
        logger.error("vllm-ascend-routing validation (row store): %s", violation)
    return found


def _freeing(free_request: Callable[..., Any], requested: Requested) -> Callable[..., Any]:
    @functools.wraps(free_request)
    def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        state = _engine_state(self, requested)
        if state.enabled:
            request_id = request.request_id
            selecting.discard(request_id)
            if not state.updating:  # ended without a last output (aborted): nothing to publish or send
                inline.discard(request_id)
                if state.publisher is not None:
                    state.publisher.drop(request_id)
            if request_id in opted_out:
                opted_out.discard(request_id)
                state.dropped.add(request_id)
            elif state.updating:  # finished with an output this step (aborts have none)
                state.records[request_id] = engine_record(request, state)
        return free_request(self, request, *args, **kwargs)

    return wrapper


def engine_record(request: Any, engine: EngineState) -> dict[str, Any]:
    """The engine core's part of a finished request's record (``output.provenance`` completes it)."""
    state = state_of(request)
    first = state.first_token
    if first is None:
        first = int(getattr(request.sampling_params, "routed_experts_prompt_start", 0) or 0)
    cached = max(0, state.cached - first)
    first_version = None if state.first_version is _UNSET else state.first_version
    return {
        "first_token": first,
        "cached": cached,
        "loaded": loaded_from(request, first),
        "weight_version": {
            "first": first_version,
            "last": engine.version,
            "cached_from": engine.cached_from if cached else None,
        },
    }


def loaded_from(request: Any, first: int) -> int:
    """The request's rows from token ``first`` on whose tokens' KV, and rows, a KV connector loaded (P/D: the
    tokens ``kv.loaded_span`` names, computed on the instance that stored that KV)."""
    span = kv.loaded_span(request)
    if span is None:
        return 0
    start, count = span
    return max(0, start + count - max(start, first))


def _resetting(reset_prefix_cache: Callable[..., Any], requested: Requested) -> Callable[..., Any]:
    @functools.wraps(reset_prefix_cache)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        reset = reset_prefix_cache(self, *args, **kwargs)
        if reset:
            _engine_state(self, requested).cached_from_pending = True
        return reset

    return wrapper
