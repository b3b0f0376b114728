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
from vllm_ascend_routing.compat.base import UnsupportedVllmError
from vllm_ascend_routing.output.frontend import INFO
from vllm_ascend_routing.patching import Patch
from vllm_ascend_routing.releases import Generation

SERVING = "serving"  # Patch.feature: verified when the server imports the module (never in engines or workers)
_GENERATIONS = (Generation.RUNNER_OUTPUT, Generation.AUX_OUTPUT)
_KEEP = "vLLM's server streams routed experts and provenance on completions and chat itself"
_COMPLETION = "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion"
_CHAT = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat"
# /inference/v1/generate's handler: here in 0.26+, in serve.disagg before (0.22-0.25)
_TOKENS = "vllm.entrypoints.scale_out.token_in_token_out.serving:ServingTokens"
_TOKENS_DISAGG = "vllm.entrypoints.serve.disagg.serving:ServingTokens"
_ARGS = ("self", "request", "result_generator")


def _row(target: str, why: str, params: tuple[str, ...] = _ARGS, required: bool = True) -> Patch:
    return Patch(target, why, _KEEP, _GENERATIONS, params, required=required, feature=SERVING)


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


def encode(routed: np.ndarray) -> str:
    """vLLM 0.22+'s encoding of an array in a response: its ``.npy`` bytes, base64."""
    with io.BytesIO() as buffer:
        np.save(buffer, routed, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def install() -> None:
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
    """The choice index of each finished output of ``item`` that has an array (completions: ``(prompt_idx, res)``)."""
    prompt_idx, result = item if completions else (0, item)
    return {
        output.index + prompt_idx * n: output
        for output in getattr(result, "outputs", ())
        if output.finish_reason is not None and getattr(output, "routed_experts", None) is not None
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
    if choice.get("routed_experts") is None:
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


def _set_info(choice: Any, output: Any) -> None:
    info = getattr(output, INFO, None)
    if info is not None:
        setattr(choice, INFO, info)  # vLLM's response models allow extra fields


def _completion_choices(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, final_res_batch: Any, *args: Any, **kwargs: Any) -> Any:
        response = method(self, final_res_batch, *args, **kwargs)
        outputs = [output for result in final_res_batch for output in result.outputs]
        for choice, output in zip(getattr(response, "choices", ()), outputs, strict=False):
            _set_info(choice, output)
        return response

    return wrapper


def _full_choices(method: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(method)

    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        pending: dict[int, Any] = {}
        bound.arguments["result_generator"] = _watching(bound.arguments["result_generator"], pending, False, 1)
        response = await method(*bound.args, **bound.kwargs)
        for choice in getattr(response, "choices", None) or ():
            output = pending.get(int(getattr(choice, "index", -1)))
            if output is not None:
                _set_info(choice, output)
        return response

    return wrapper
