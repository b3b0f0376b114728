# SPDX-License-Identifier: Apache-2.0
"""The front end's side: per-request options checked when a request arrives, records attached to the outputs.

* ``InputProcessor.process_inputs`` (every generation): a request's options (``output.options``) are checked
  against this engine: refused, for that request only, where the engine cannot honour them (``True`` on an engine
  started without ``--enable-return-routed-experts``; any option on vLLM 0.20.x / 0.21.0, whose transports return
  every request's rows); ``routed_experts_omit=N`` becomes ``routed_experts_prompt_start`` on the request vLLM
  sends to the engine core (its own copy of the parameters).
* ``OutputProcessor.process_outputs`` (0.22+): the engine core's record of a finishing request is taken out of
  its ``kv_transfer_params`` (``output.engine.RECORD_KEY``) before vLLM reads them.
* ``RequestState._new_request_output`` / ``ParentRequest.get_outputs`` (0.22+): each finished
  ``CompletionOutput`` gets ``routed_experts_info``, the completed record (``output.provenance``), or ``None``
  where it has no array.
* ``RequestOutput.add`` (every generation): a streamed request whose consumer lags gets its outputs merged into the
  oldest one not yet taken (``aggregate``, AsyncLLM's per-request collector); the terminal output's rows (vLLM
  0.30.0 and earlier drop them there) and its ``routed_experts_info`` are carried into the merged one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_ascend_routing import patching, validate
from vllm_ascend_routing.output import engine, options, provenance
from vllm_ascend_routing.patching import Patch
from vllm_ascend_routing.store import keys as store_keys
from vllm_ascend_routing.store import setting as store_setting

INFO = "routed_experts_info"  # CompletionOutput attribute, and the HTTP choice field
_RECORD = "_vllm_ascend_routing_record"  # front-end RequestState attribute: the engine core's part of the record
_KEEP = "never while per-request routed-experts options exist"
_NEEDS = "per_request_output"  # the adapter capability the record rows need (the options check runs everywhere)
PROCESS_INPUTS = Patch(
    "vllm.v1.engine.input_processor:InputProcessor.process_inputs",
    "check a request's routed-experts options against this engine; routed_experts_omit=N as the prompt start",
    _KEEP,
    params=("self", "request_id", "prompt", "params"),
)
_OUTPUT = "vllm.v1.engine.output_processor"
PROCESS_OUTPUTS = Patch(
    f"{_OUTPUT}:OutputProcessor.process_outputs",
    "take the engine core's provenance records out of kv_transfer_params",
    _KEEP,
    params=("self", "engine_core_outputs"),
    needs=_NEEDS,
)
NEW_REQUEST_OUTPUT = Patch(
    f"{_OUTPUT}:RequestState._new_request_output",
    "routed_experts_info on a finished request's CompletionOutput",
    _KEEP,
    params=("self", "external_req_id", "outputs", "finished"),
    needs=_NEEDS,
)
GET_OUTPUTS = Patch(
    "vllm.v1.engine.parallel_sampling:ParentRequest.get_outputs",
    "routed_experts_info on each finished sample of an n > 1 request",
    _KEEP,
    params=("self", "child_request_id", "completion_output"),
    needs=_NEEDS,
)
MERGE_OUTPUTS = Patch(
    "vllm.outputs:RequestOutput.add",
    "a lagging stream's merged output keeps its terminal rows and routed_experts_info",
    "once vLLM's merge carries every field of the terminal CompletionOutput (0.32 carries the rows, not the record)",
    params=("self", "next_output", "aggregate"),
)
PATCHES = (PROCESS_INPUTS, MERGE_OUTPUTS, PROCESS_OUTPUTS, NEW_REQUEST_OUTPUT, GET_OUTPUTS)

_records: dict[str, dict[str, Any]] = {}  # finished samples of n > 1 requests, by internal request id


def install(adapter: Any, vllm: str) -> None:
    """Patch this front end (idempotent): the check on every generation, the records where the engine sends them
    (``adapter.per_request_output``)."""
    serves = bool(adapter.per_request_output)
    patching.replace(PROCESS_INPUTS, lambda method: _checking(method, adapter, serves))
    patching.replace(MERGE_OUTPUTS, _merging)
    if serves:
        attach = functools.partial(_attach, generation=adapter.generation.value, vllm=vllm)
        patching.replace(PROCESS_OUTPUTS, _taking_records)
        patching.replace(NEW_REQUEST_OUTPUT, lambda method: _recording(method, attach))
        patching.replace(GET_OUTPUTS, lambda method: _recording_samples(method, attach))


def check(
    found: options.RequestOptions, transport: str, serves: bool, engine_returns: bool, *, stores: bool = False
) -> None:
    """Refuse ``found`` where this engine cannot honour it (``RequestOptionError``, a ``ValueError``: vLLM's front
    end turns it into the request's error, HTTP 400)."""
    if found is options.NONE:
        return
    if not serves:
        raise options.RequestOptionError(
            f"per-request routed-experts options ({', '.join(options.KEYS)}) need vLLM 0.22 or later: this vLLM's "
            f"routed-experts transport ({transport}) returns every request's rows; remove them from the request"
        )
    if found.returns and not engine_returns:
        raise options.RequestOptionError(
            f"{options.RETURN}=true, but this engine was started without --enable-return-routed-experts "
            "(LLM(enable_return_routed_experts=True)): it records no routing for any request; restart it with the "
            "flag (requests can then opt out with false)"
        )
    if found.transport == "store" and not stores:
        raise options.RequestOptionError(
            f"{options.TRANSPORT}='store', but this engine has no row store (VLLM_ASCEND_ROUTING_STORE unset): its "
            "rows are returned inline; drop the option or start the engine with a store"
        )


def _checking(process_inputs: Callable[..., Any], adapter: Any, serves: bool) -> Callable[..., Any]:
    @functools.wraps(process_inputs)
    def wrapper(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        found = options.of(params)
        if found is not options.NONE:
            engine_returns = adapter.routed_experts_requested(self.vllm_config)
            stores = store_setting.current() is not None
            check(found, adapter.generation.value, serves, engine_returns, stores=stores)
        request = process_inputs(self, request_id, prompt, params, *args, **kwargs)
        if found.omit_before:
            prompt_len = len(request.prompt_token_ids) if request.prompt_token_ids is not None else None
            if prompt_len is not None and found.omit_before >= prompt_len:
                raise options.RequestOptionError(
                    f"{options.OMIT}={found.omit_before}: past the last of the prompt's {prompt_len} tokens (rows "
                    f"before a token of the prompt can be omitted: at most {prompt_len - 1})"
                )
            params = request.sampling_params  # vLLM's copy for this request
            params.routed_experts_prompt_start = max(int(params.routed_experts_prompt_start or 0), found.omit_before)
        return request

    return wrapper


def _taking_records(process_outputs: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(process_outputs)
    def wrapper(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        for output in engine_core_outputs:
            params = output.kv_transfer_params
            if params is None or engine.RECORD_KEY not in params:
                continue
            params = dict(params)
            record = params.pop(engine.RECORD_KEY)
            output.kv_transfer_params = params or None
            state = self.request_states.get(output.request_id)
            if state is None:
                continue
            if state.parent_req is None:
                setattr(state, _RECORD, record)
            else:  # one sample of an n > 1 request: attached when the parent collects it
                _records[output.request_id] = record
            validate.rows_start(state, int(record["first_token"]))  # where the engine moved the first row
        return process_outputs(self, engine_core_outputs, *args, **kwargs)

    return wrapper


def _attach(output: Any, record: dict[str, Any] | None, *, generation: str, vllm: str) -> None:
    """``routed_experts_info`` on a finished ``CompletionOutput``: the record of its array (inline or stored), or
    ``None``."""
    routed = getattr(output, "routed_experts", None)
    if record is not None and record.get(provenance.VIOLATIONS) and provenance.STORE_KEY not in record:
        # strict validation in the engine core refused to store them: the request fails, as for a returned array
        raise validate.RoutingValidationError("; ".join(record[provenance.VIOLATIONS]))
    stored = record is not None and routed is None and provenance.STORE_KEY in record
    info = (
        None
        if record is None or (routed is None and not stored)
        else provenance.complete(record, routed, generation, vllm)
    )
    setattr(output, INFO, info)


def _kept_rows(state: Any, record: dict[str, Any]) -> None:
    """A stored request's rows cut to the tokens the front end kept (vLLM 0.31+ drops tokens accepted past a stop
    string here, and their rows from an inline array): the record's shape and its key (``@rows``) say how many."""
    detokenizer = getattr(state, "detokenizer", None)
    counted = getattr(detokenizer, "num_output_tokens", None)
    if provenance.STORE_KEY not in record or counted is None:
        return
    kept = int(state.prompt_len) + int(counted()) - 1 - int(record["first_token"])
    if 0 <= kept < int(record["shape"][0]):
        record["shape"] = [kept, *record["shape"][1:]]
        record[provenance.STORE_KEY] = store_keys.parse(record[provenance.STORE_KEY]).with_rows(kept)


def _recording(new_request_output: Callable[..., Any], attach: Callable[..., None]) -> Callable[..., Any]:
    @functools.wraps(new_request_output)
    def wrapper(self: Any, external_req_id: str, outputs: Any, finished: bool, *args: Any, **kwargs: Any) -> Any:
        record = self.__dict__.pop(_RECORD, None)
        if finished:
            sample = record if self.parent_req is None else _records.get(self.request_id)
            if sample is not None:
                _kept_rows(self, sample)
        if self.parent_req is None:
            for output in outputs:
                if _is_finished_completion(output):
                    attach(output, record)
        return new_request_output(self, external_req_id, outputs, finished, *args, **kwargs)

    return wrapper


def _recording_samples(get_outputs: Callable[..., Any], attach: Callable[..., None]) -> Callable[..., Any]:
    @functools.wraps(get_outputs)
    def wrapper(self: Any, child_request_id: str, completion_output: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_finished_completion(completion_output):
            attach(completion_output, _records.pop(child_request_id, None))
        return get_outputs(self, child_request_id, completion_output, *args, **kwargs)

    return wrapper


def _is_finished_completion(output: Any) -> bool:
    return getattr(output, "finish_reason", None) is not None and hasattr(output, "routed_experts")


def _merging(add: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(add)
    def wrapper(self: Any, next_output: Any, aggregate: bool, *args: Any, **kwargs: Any) -> Any:
        merged = add(self, next_output, aggregate, *args, **kwargs)
        if aggregate:
            carry_terminal_fields(self.outputs, next_output.outputs)
        return merged

    return wrapper


def carry_terminal_fields(merged: Any, latest: Any) -> None:
    """Onto each completion of ``merged`` (the older outputs, edited in place by vLLM's merge), the rows and the
    record of the ``latest`` completion with its index: only a finished completion has them, and a merge must not
    lose them (a stream whose last chunk came without rows would look like an opted-out request's)."""
    by_index = {getattr(completion, "index", None): completion for completion in merged}
    for completion in latest:
        into = by_index.get(getattr(completion, "index", None))
        if into is None or into is completion:
            continue
        routed = getattr(completion, "routed_experts", None)
        if routed is not None:
            into.routed_experts = routed
        if hasattr(completion, INFO):
            setattr(into, INFO, getattr(completion, INFO))
