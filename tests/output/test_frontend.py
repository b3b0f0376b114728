# SPDX-License-Identifier: Apache-2.0
"""The front end: options refused per request where the engine cannot honour them; records attached to outputs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_ascend_routing import validate
from vllm_ascend_routing.output import engine, frontend, options
from vllm_ascend_routing.releases import Generation

OPT_OUT = options.RequestOptions(returns=False)
OPT_IN = options.RequestOptions(returns=True)


def test_true_on_an_engine_without_the_flag_is_refused_for_that_request() -> None:
    with pytest.raises(options.RequestOptionError, match="started without --enable-return-routed-experts"):
        frontend.check(OPT_IN, Generation.RUNNER_OUTPUT.value, serves=True, engine_returns=False)
    frontend.check(OPT_OUT, Generation.RUNNER_OUTPUT.value, serves=True, engine_returns=False)  # nothing to opt out of
    frontend.check(OPT_IN, Generation.AUX_OUTPUT.value, serves=True, engine_returns=True)
    frontend.check(options.NONE, Generation.SHM.value, serves=False, engine_returns=True)  # asks nothing: vLLM as usual


@pytest.mark.parametrize("generation", [Generation.SHM, Generation.DEVICE_CACHE])
def test_any_option_on_vllm_0_20_and_0_21_is_refused_for_that_request(generation: Generation) -> None:
    with pytest.raises(options.RequestOptionError, match=f"need vLLM 0.22 or later.*\\({generation.value}\\)"):
        frontend.check(OPT_OUT, generation.value, serves=False, engine_returns=True)


class Processor:
    """vLLM's InputProcessor as the hook sees it: it copies the params onto the request it returns."""

    vllm_config = object()

    def process_inputs(self, request_id: str, prompt: Any, params: Any) -> Any:
        copied = SimpleNamespace(**vars(params))
        return SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], sampling_params=copied)


@pytest.fixture
def processor(monkeypatch: pytest.MonkeyPatch) -> Processor:
    adapter = SimpleNamespace(generation=Generation.RUNNER_OUTPUT, routed_experts_requested=lambda config: True)
    hooked = type("HookedProcessor", (Processor,), {})
    hooked.process_inputs = frontend._checking(Processor.process_inputs, adapter, True)  # type: ignore[method-assign]
    return hooked()


def params(extra_args: dict[str, Any] | None, start: int = 0) -> Any:
    return SimpleNamespace(extra_args=extra_args, routed_experts_prompt_start=start)


def test_omit_before_a_token_becomes_the_prompt_start_of_vllms_copy(processor: Processor) -> None:
    mine = params({"routed_experts_omit": 7}, start=3)
    request = processor.process_inputs("r", {"prompt_token_ids": list(range(10))}, mine)
    assert request.sampling_params.routed_experts_prompt_start == 7 and mine.routed_experts_prompt_start == 3
    later = processor.process_inputs("r", {"prompt_token_ids": list(range(10))}, params({"routed_experts_omit": 2}, 5))
    assert later.sampling_params.routed_experts_prompt_start == 5  # the caller's own start, when later, stays


def test_omit_past_the_prompt_and_malformed_options_are_refused(processor: Processor) -> None:
    with pytest.raises(options.RequestOptionError, match="past the last of the prompt's 10 tokens.*at most 9"):
        processor.process_inputs("r", {"prompt_token_ids": list(range(10))}, params({"routed_experts_omit": 10}))
    request = processor.process_inputs("r", {"prompt_token_ids": list(range(10))}, params({"routed_experts_omit": 9}))
    assert request.sampling_params.routed_experts_prompt_start == 9
    with pytest.raises(ValueError, match="expected true or false"):
        processor.process_inputs("r", {"prompt_token_ids": [1]}, params({"return_routed_experts": "x"}))


class State:
    """A front-end RequestState: its id, its parent (n > 1) and vLLM's builder of the request's output."""

    def __init__(self, request_id: str, parent: Any = None) -> None:
        self.request_id, self.parent_req = request_id, parent

    def _new_request_output(self, external_req_id: str, outputs: list[Any], finished: bool) -> list[Any]:
        return outputs


def completion(routed: np.ndarray | None, finished: bool = True) -> Any:
    return SimpleNamespace(routed_experts=routed, finish_reason="length" if finished else None)


def test_records_travel_out_of_kv_transfer_params_onto_the_finished_output() -> None:
    record = {"first_token": 2, "cached": 1, "loaded": 0, "weight_version": {"first": 1, "last": 1, "cached_from": 1}}
    single, sample = State("a"), State("b-1", parent=object())
    processor = SimpleNamespace(request_states={"a": single, "b-1": sample})
    outputs = [
        SimpleNamespace(request_id="a", kv_transfer_params={engine.RECORD_KEY: record}),
        SimpleNamespace(request_id="b-1", kv_transfer_params={engine.RECORD_KEY: record, "remote": 1}),
        SimpleNamespace(request_id="c", kv_transfer_params=None),
    ]
    frontend._taking_records(lambda self, outs: outs)(processor, outputs)
    assert outputs[0].kv_transfer_params is None and outputs[1].kv_transfer_params == {"remote": 1}
    assert getattr(single, validate._PROMPT_START) == 2  # validation mode checks the rows from the moved start

    attach = frontend.functools.partial(frontend._attach, generation="runner-output", vllm="0.30.0")
    routed = np.zeros((6, 3, 2), np.uint8)
    finished, streaming = completion(routed), completion(None, finished=False)
    frontend._recording(State._new_request_output, attach)(single, "a", [finished], True)
    assert finished.routed_experts_info["rows"] == 6 and finished.routed_experts_info["computed"] == 5
    frontend._recording(State._new_request_output, attach)(State("d"), "d", [streaming], False)
    assert not hasattr(streaming, "routed_experts_info")  # only finished outputs carry it
    child = completion(routed)
    frontend._recording_samples(lambda self, request_id, output: ([output], True), attach)(None, "b-1", child)
    assert child.routed_experts_info["first_token"] == 2
    opted_out = completion(None)
    frontend._recording(State._new_request_output, attach)(State("e"), "e", [opted_out], True)
    assert opted_out.routed_experts_info is None  # no array, no record (and the attribute always exists)


def merged_stream(routed: list[np.ndarray]) -> tuple[Any, list[Any]]:
    """An n=2 stream's first outputs (not finished) and, per choice, a finishing one with its own rows and record."""
    older = [SimpleNamespace(index=i, token_ids=[i], routed_experts=None, finish_reason=None) for i in (0, 1)]
    finishing = []
    for i, rows in enumerate(routed):
        done = SimpleNamespace(index=i, token_ids=[10 + i], routed_experts=rows, finish_reason="length")
        done.routed_experts_info = {"rows": len(rows), "choice": i}
        finishing.append(done)
    return SimpleNamespace(outputs=older), finishing


def merge_as_vllm_0_30_does(self: Any, next_output: Any, aggregate: bool) -> None:
    """vLLM 0.30.0's ``RequestOutput.add``: aggregating keeps the older completion and takes the newer one's tokens
    and finish reason, not its rows (nor any attribute the plugin added)."""
    for latest in next_output.outputs:
        for i, completion in enumerate(self.outputs):
            if completion.index == latest.index:
                if aggregate:
                    completion.token_ids = [*completion.token_ids, *latest.token_ids]
                    completion.finish_reason = latest.finish_reason
                else:
                    self.outputs[i] = latest


def test_a_lagging_streams_merged_output_keeps_each_choices_rows_and_record() -> None:
    routed = [np.full((3, 2, 2), 1, np.uint8), np.full((5, 2, 2), 2, np.uint8)]  # distinct per choice
    pending, (first, second) = merged_stream(routed)
    merge = frontend._merging(merge_as_vllm_0_30_does)
    merge(pending, SimpleNamespace(outputs=[second]), True)  # choice 1 finishes while choice 0 still streams
    zero, one = pending.outputs
    assert one.routed_experts is routed[1] and one.routed_experts_info == {"rows": 5, "choice": 1}
    assert zero.routed_experts is None and not hasattr(zero, "routed_experts_info")
    assert one.token_ids == [1, 11] and one.finish_reason == "length"  # vLLM's own merge ran
    merge(pending, SimpleNamespace(outputs=[first]), aggregate=True)
    assert zero.routed_experts is routed[0] and zero.routed_experts_info == {"rows": 3, "choice": 0}
    assert one.routed_experts is routed[1] and one.routed_experts_info["choice"] == 1  # untouched by choice 0's


def test_a_merge_carries_a_record_of_none_and_never_rows_of_none() -> None:
    pending, (first, _) = merged_stream([np.zeros((2, 1, 1), np.uint8)] * 2)
    earlier = np.ones((2, 1, 1), np.uint8)
    pending.outputs[0].routed_experts = earlier
    first.routed_experts, first.routed_experts_info = None, None  # an opted-out choice: no rows, a record of None
    frontend._merging(merge_as_vllm_0_30_does)(pending, SimpleNamespace(outputs=[first]), True)
    assert pending.outputs[0].routed_experts is earlier and pending.outputs[0].routed_experts_info is None


def test_replacing_outputs_needs_no_carrying() -> None:
    pending, (first, _) = merged_stream([np.zeros((2, 1, 1), np.uint8)] * 2)
    frontend._merging(merge_as_vllm_0_30_does)(pending, SimpleNamespace(outputs=[first]), False)
    assert pending.outputs[0] is first and first.routed_experts_info["choice"] == 0


@pytest.mark.vllm
def test_vllms_own_collector_hands_a_lagging_consumer_the_rows_and_record() -> None:
    """vLLM's ``RequestOutputCollector`` (between the output handler and a stream's consumer) merges outputs the
    consumer has not taken yet: with the plugin's merge, the one taken holds the terminal rows and record."""
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    from vllm_ascend_routing import patching

    def output(index: int, token: int, rows: np.ndarray | None) -> RequestOutput:
        completion = CompletionOutput(index, "", [token], None, None, finish_reason=None if rows is None else "length")
        completion.routed_experts = rows
        if rows is not None:
            setattr(completion, frontend.INFO, {"rows": len(rows)})
        return RequestOutput("r", None, [1, 2], None, [completion], finished=rows is not None)

    routed = np.arange(12, dtype=np.int16).reshape(3, 2, 2)
    original = getattr(RequestOutput.add, patching.ORIGINAL, RequestOutput.add)
    try:
        RequestOutput.add = frontend._merging(original)
        collector = RequestOutputCollector(RequestOutputKind.DELTA, "r")
        for item in (output(0, 5, None), output(0, 6, None), output(0, 7, routed)):
            collector.put(item)  # nobody takes them in between: the consumer lags
        taken = collector.get_nowait()
    finally:
        RequestOutput.add = original
    (completion,) = taken.outputs
    assert list(completion.token_ids) == [5, 6, 7] and completion.finish_reason == "length"
    assert np.array_equal(completion.routed_experts, routed)
    assert getattr(completion, frontend.INFO) == {"rows": 3}
