# SPDX-License-Identifier: Apache-2.0
"""vLLM's HTTP server (0.22+): ``routed_experts_info`` beside ``routed_experts`` in each choice, and the rows in the
final chunk of each streamed choice.

Non-streamed responses (completions, chat completions, ``/inference/v1/generate``) keep vLLM's choices as they are
and gain ``routed_experts_info``. Streamed ones: the chunk that finishes a choice (``finish_reason`` set) gains
``routed_experts`` in the non-streamed encoding (a base64 ``.npy``: ``encode``) and ``routed_experts_info``; where
vLLM's generate stream already sends the rows there, only the record is added. Each wrapped generator watches the
``RequestOutput``s vLLM's own code consumes (its ``result_generator`` argument) and edits only the finishing chunk
of a choice that has an array, so other chunks pass through untouched (not even parsed).

Patched when vLLM's serving modules are imported (only the API server imports them), and checked then: a moved
target refuses the server's start-up by name (``install``).
"""

from __future__ import annotations

import base64
import functools
import inspect
import io
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from vllm_ascend_routing import patching
from vllm_ascend_routing._post_import import when_imported
from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.output.frontend import INFO
from vllm_ascend_routing.patching import Patch

SERVING = "serving"  # Patch.feature: verified when the server imports the module (never in engines or workers)
_NEEDS = "per_request_output"  # the records these fields show come per request through the engine core
_KEEP = "vLLM's server streams routed experts and provenance on completions and chat itself"
_COMPLETION = "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion"
_CHAT = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat"
# /inference/v1/generate's handler: here in 0.26+, in serve.disagg before (0.22-0.25)
_TOKENS = "vllm.entrypoints.scale_out.token_in_token_out.serving:ServingTokens"
_TOKENS_DISAGG = "vllm.entrypoints.serve.disagg.serving:ServingTokens"
_ARGS = ("self", "request", "result_generator")


def _row(target: str, why: str, params: tuple[str, ...] = _ARGS, required: bool = True) -> Patch:
    return Patch(target, why, _KEEP, params=params, required=required, feature=SERVING, needs=_NEEDS)


COMPLETION_STREAM = _row(f"{_COMPLETION}.completion_stream_generator", "rows and record in the final chunk")
COMPLETION_FULL = _row(
    f"{_COMPLETION}.request_output_to_completion_response",
    "routed_experts_info in each choice",
    ("self", "final_res_batch", "request"),
)
CHAT_STREAM = _row(f"{_CHAT}.chat_completion_stream_generator", "rows and record in the final chunk")
CHAT_FULL = _row(f"{_CHAT}.chat_completion_full_generator", "routed_experts_info in each choice")
_GENERATE_STREAM = "rows (where vLLM's stream lacks them) and record in the final chunk"
TOKENS_STREAM = _row(f"{_TOKENS}.serve_tokens_stream_generator", _GENERATE_STREAM, required=False)
_GENERATE_FULL = "routed_experts_info in each choice"
TOKENS_FULL = _row(f"{_TOKENS}.serve_tokens_full_generator", _GENERATE_FULL, required=False)
DISAGG_STREAM = _row(f"{_TOKENS_DISAGG}.serve_tokens_stream_generator", _GENERATE_STREAM, required=False)
DISAGG_FULL = _row(f"{_TOKENS_DISAGG}.serve_tokens_full_generator", _GENERATE_FULL, required=False)
STREAMS = (COMPLETION_STREAM, CHAT_STREAM, TOKENS_STREAM, DISAGG_STREAM)
PATCHES = (*STREAMS, COMPLETION_FULL, CHAT_FULL, TOKENS_FULL, DISAGG_FULL)
NEEDS = (_NEEDS,)


def encode(routed: np.ndarray) -> str:
    """vLLM 0.22+'s encoding of an array in a response: its ``.npy`` bytes, base64."""
    with io.BytesIO() as buffer:
        np.save(buffer, routed, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def install(ctx: InstallContext | None = None) -> None:
    """Patch each serving module once vLLM's server imports it (now, if it already has)."""
    for module in dict.fromkeys(patch.target.partition(":")[0] for patch in PATCHES):
        when_imported(module, functools.partial(_patched_on_import, name=module))


def _patched_on_import(_module: Any, *, name: str) -> None:
    _patch_module(name)


def _patch_module(module: str) -> None:
    rows = [patch for patch in PATCHES if patch.target.startswith(f"{module}:")]
    problems = [problem for problem in map(patching.problem, rows) if problem is not None]
    if problems:
        raise UnsupportedVllmError(
            "vllm-ascend-routing: vLLM's server changed what the plugin patches:\n  - "
            + "\n  - ".join(problems)
            + "\nPin a supported vLLM release or unset VLLM_ASCEND_ROUTING."
        )
    for patch in PATCHES:
        if patch in rows:
            patching.replace(patch, _maker(patch))


def _maker(patch: Patch) -> Callable[[Any], Any]:
    if patch in STREAMS:  # completions yield (prompt index, output) pairs
        return functools.partial(_streaming, completions=patch is COMPLETION_STREAM)
    return _completion_choices if patch is COMPLETION_FULL else _full_choices


def _finished_arrays(item: Any, completions: bool, n: int) -> dict[int, Any]:
    """The choice index of each finished output of ``item`` that has an array, or a record (a store engine's: its
    key), (completions: ``(prompt_idx, res)``)."""
    prompt_idx, result = item if completions else (0, item)
    return {
        output.index + prompt_idx * n: output
        for output in getattr(result, "outputs", ())
        if output.finish_reason is not None
        and (getattr(output, "routed_experts", None) is not None or getattr(output, INFO, None) is not None)
    }


async def _watching(source: AsyncIterator[Any], pending: dict[int, Any], completions: bool, n: int) -> Any:
    async for item in source:
        pending.update(_finished_arrays(item, completions, n))
        yield item


def _streaming(method: Callable[..., Any], *, completions: bool) -> Callable[..., Any]:
    signature = inspect.signature(method)

    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        n = int(getattr(bound.arguments["request"], "n", None) or 1)
        pending: dict[int, Any] = {}
        bound.arguments["result_generator"] = _watching(bound.arguments["result_generator"], pending, completions, n)
        last = ""
        async for chunk in method(*bound.args, **bound.kwargs):
            if chunk.startswith("data: {"):
                last = chunk
                if pending and '"finish_reason":"' in chunk:  # a chunk that finishes a choice
                    chunk = _with_rows(chunk, pending)
            elif pending and chunk.startswith("data: [DONE]") and last:
                yield _rows_chunk(last, pending)  # a choice vLLM finished without a chunk of its own
            yield chunk

    return wrapper


def _add_fields(choice: dict[str, Any], output: Any) -> None:
    """The rows (unless vLLM's own stream sent them: its generate endpoint from 0.26) and the record."""
    if choice.get("routed_experts") is None and output.routed_experts is not None:  # None: behind a store key
        choice["routed_experts"] = encode(output.routed_experts)
    choice[INFO] = getattr(output, INFO, None)


def _with_rows(chunk: str, pending: dict[int, Any]) -> str:
    body = json.loads(chunk[len("data: ") :])
    changed = False
    for choice in body.get("choices") or ():
        output = pending.get(choice.get("index"))
        if output is not None and choice.get("finish_reason") is not None:
            _add_fields(choice, pending.pop(choice["index"]))
            changed = True
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n" if changed else chunk


def _rows_chunk(last: str, pending: dict[int, Any]) -> str:
    body = json.loads(last[len("data: ") :])
    body["choices"] = []
    for index, output in sorted(pending.items()):
        choice = {"index": index, "finish_reason": output.finish_reason}
        _add_fields(choice, output)
        body["choices"].append(choice)
    body.pop("usage", None)
    pending.clear()
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _with_infos(response: Any, infos: dict[int, Any]) -> Any:
    """``response`` with ``routed_experts_info`` in each choice that has one (``infos``: by choice index)."""
    infos = {index: info for index, info in infos.items() if info is not None}
    if not infos:
        return response
    try:
        for choice in getattr(response, "choices", None) or ():
            if getattr(choice, "index", None) in infos:
                setattr(choice, INFO, infos[choice.index])  # vLLM's OpenAI response models allow extra fields
        return response
    except ValueError:  # one that does not (the generate endpoint's): the record joins it when it is dumped
        response_type: Any = type(response)
        return _dumped_with_infos(response_type)(response, infos)


@functools.cache
def _dumped_with_infos(response_type: Any) -> Callable[[Any, dict[int, Any]], Any]:
    """A subclass of the pydantic ``response_type`` whose dumps add ``routed_experts_info`` to its choices (vLLM's
    routers serve ``response.model_dump()``), and the function turning a response into one."""
    from pydantic import PrivateAttr

    def model_dump(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        dumped: dict[str, Any] = response_type.model_dump(self, *args, **kwargs)
        for choice in dumped.get("choices") or ():
            if choice.get("index") in self._routed_experts_infos:
                choice[INFO] = self._routed_experts_infos[choice["index"]]
        return dumped

    def model_dump_json(self: Any, *args: Any, **kwargs: Any) -> str:
        return json.dumps(model_dump(self, *args, mode="json", **kwargs), separators=(",", ":"))

    namespace = {"_routed_experts_infos": PrivateAttr(default_factory=dict), "model_dump": model_dump}
    dumping: Any = type(response_type.__name__, (response_type,), {**namespace, "model_dump_json": model_dump_json})

    def convert(response: Any, infos: dict[int, Any]) -> Any:
        fields = {name: getattr(response, name) for name in type(response).model_fields}
        converted = dumping.model_construct(_fields_set=set(response.model_fields_set), **fields)
        converted._routed_experts_infos = infos
        return converted

    return convert


def _completion_choices(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, final_res_batch: Any, *args: Any, **kwargs: Any) -> Any:
        response = method(self, final_res_batch, *args, **kwargs)
        outputs = [output for result in final_res_batch for output in result.outputs]  # choice i is output i
        return _with_infos(response, {index: getattr(out, INFO, None) for index, out in enumerate(outputs)})

    return wrapper


def _full_choices(method: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(method)

    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        pending: dict[int, Any] = {}
        bound.arguments["result_generator"] = _watching(bound.arguments["result_generator"], pending, False, 1)
        response = await method(*bound.args, **bound.kwargs)
        return _with_infos(response, {index: getattr(out, INFO, None) for index, out in pending.items()})

    return wrapper
