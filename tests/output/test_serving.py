# SPDX-License-Identifier: Apache-2.0
"""The server's streams: rows and record added to the chunk that finishes a choice, every other chunk untouched."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_ascend_routing.output import serving

ROUTED = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
INFO = {"first_token": 0, "rows": 4}


def result(index: int, finished: bool, routed: np.ndarray | None = ROUTED) -> Any:
    output = SimpleNamespace(
        index=index, finish_reason="length" if finished else None, routed_experts=routed if finished else None
    )
    output.routed_experts_info = INFO if finished and routed is not None else None
    return SimpleNamespace(outputs=[output])


def chunk(index: int, finish_reason: str | None, **extra: Any) -> str:
    choice = {"index": index, "text": "t", "finish_reason": finish_reason, **extra}
    return f"data: {json.dumps({'id': 'x', 'choices': [choice]}, separators=(',', ':'))}\n\n"


class Serving:
    """A stream generator shaped as vLLM's: one chunk per RequestOutput it consumes, then [DONE]."""

    async def completion_stream_generator(self, request: Any, result_generator: Any) -> Any:
        async for prompt_idx, res in result_generator:
            for output in res.outputs:
                if output.index != 9:  # vLLM skips a choice that has no text (a chunked prefill's empty output)
                    yield chunk(output.index + prompt_idx * request.n, output.finish_reason)
        yield "data: [DONE]\n\n"


async def drain(items: list[Any], n: int = 1) -> list[str]:
    async def source() -> Any:
        for item in items:
            yield item

    wrapped = serving._streaming(Serving.completion_stream_generator, completions=True)
    return [c async for c in wrapped(Serving(), SimpleNamespace(n=n), source())]


def decode(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)))


def test_the_finishing_chunk_of_each_choice_gets_the_rows_and_record() -> None:
    items = [(0, result(0, False)), (1, result(0, False)), (1, result(0, True)), (0, result(0, True))]
    chunks = asyncio.run(drain(items, n=1))
    assert chunks[0] == chunk(0, None) and chunks[1] == chunk(1, None)  # untouched
    finishing = [json.loads(c[len("data: ") :])["choices"][0] for c in chunks[2:4]]
    assert [c["index"] for c in finishing] == [1, 0]  # prompt 1's choice is index 1 (n = 1)
    for choice in finishing:
        np.testing.assert_array_equal(decode(choice["routed_experts"]), ROUTED)
        assert choice["routed_experts_info"] == INFO and decode(choice["routed_experts"]).dtype == np.uint8
    assert chunks[-1] == "data: [DONE]\n\n"


def test_a_choice_without_an_array_streams_as_vllm_sent_it() -> None:
    chunks = asyncio.run(drain([(0, result(0, True, routed=None))]))
    assert chunks == [chunk(0, "length"), "data: [DONE]\n\n"]


def test_a_choice_finished_without_a_chunk_of_its_own_gets_one_before_done() -> None:
    chunks = asyncio.run(drain([(0, result(1, False)), (0, result(9, True))], n=10))
    assert len(chunks) == 3
    extra = json.loads(chunks[-2][len("data: ") :])
    assert extra["id"] == "x" and extra["choices"][0]["index"] == 9 and extra["choices"][0]["finish_reason"] == "length"
    np.testing.assert_array_equal(decode(extra["choices"][0]["routed_experts"]), ROUTED)


def test_rows_vllm_already_streams_are_left_as_they_are() -> None:
    pending = {0: result(0, True).outputs[0]}
    done = serving._with_rows(chunk(0, "stop", routed_experts="VLLM"), pending)
    choice = json.loads(done[len("data: ") :])["choices"][0]
    assert choice["routed_experts"] == "VLLM" and choice["routed_experts_info"] == INFO and not pending


def test_encode_is_vllms_non_streamed_encoding() -> None:
    assert decode(serving.encode(ROUTED)).tobytes() == ROUTED.tobytes()
    buffer = io.BytesIO()
    np.save(buffer, ROUTED, allow_pickle=False)
    assert serving.encode(ROUTED) == base64.b64encode(buffer.getvalue()).decode("ascii")


def test_non_streamed_choices_get_the_record_whatever_their_model_allows() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Choice(pydantic.BaseModel):  # vLLM's generate endpoint: no extra fields
        index: int
        routed_experts: str | None = None

    class Response(pydantic.BaseModel):
        id: str
        choices: list[Choice]

    class OpenChoice(Choice):  # vLLM's OpenAI models: extra fields allowed
        model_config = pydantic.ConfigDict(extra="allow")

    class OpenResponse(pydantic.BaseModel):
        choices: list[OpenChoice]

    infos = {1: INFO}
    served = serving._with_infos(Response(id="x", choices=[Choice(index=0), Choice(index=1)]), infos)
    assert isinstance(served, Response)  # vLLM's router checks the response type
    assert served.model_dump()["choices"] == [
        {"index": 0, "routed_experts": None},
        {"index": 1, "routed_experts": None, "routed_experts_info": INFO},
    ]
    assert json.loads(served.model_dump_json())["choices"][1]["routed_experts_info"] == INFO
    opened = serving._with_infos(OpenResponse(choices=[OpenChoice(index=1)]), infos)
    assert opened.model_dump()["choices"][0]["routed_experts_info"] == INFO
    plain = Response(id="y", choices=[Choice(index=0)])
    assert serving._with_infos(plain, {0: None}) is plain  # nothing to add: vLLM's object as it was
