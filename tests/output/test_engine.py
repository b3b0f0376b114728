# SPDX-License-Identifier: Apache-2.0
"""The engine core's side, on a stand-in scheduler shaped as vLLM 0.22+'s: options read once, the first row decided
at the first scheduling, opted-out rows dropped, records with the weight versions of the steps."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.test_kv_transfer import follow
from tests.test_kv_transfer import rows as kv_rows
from vllm_ascend_routing import kv
from vllm_ascend_routing.output import engine, provenance, weights


@dataclass
class Output:  # EngineCoreOutput's fields the hooks touch
    request_id: str
    routed_experts: np.ndarray | None
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


def request(
    request_id: str, prompt: int, extra_args: dict[str, Any] | None = None, cached: int = 0, start: int = 0
) -> Any:
    params = SimpleNamespace(extra_args=extra_args, routed_experts_prompt_start=start)
    return SimpleNamespace(
        request_id=request_id,
        sampling_params=params,
        num_prompt_tokens=prompt,
        prefill_stats=SimpleNamespace(num_local_cached_tokens=cached),
    )


class Scheduler:
    """vLLM's scheduler as the hooks see it: each step emits one chunk of rows per scheduled request and frees the
    requests that finish (inside ``update_from_output``); the rows start where the request's params say."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.read_starts: dict[str, int] = {}

    def add_request(self, request: Any) -> None:
        self.requests[request.request_id] = request

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        outputs = []
        for request_id in scheduler_output.scheduled:
            request = self.requests[request_id]
            self.read_starts.setdefault(request_id, request.sampling_params.routed_experts_prompt_start)
            finished = request_id in scheduler_output.finishing
            outputs.append(Output(request_id, np.ones((1, 2, 2), np.uint8), "stop" if finished else None))
            if finished:
                self._free_request(request)
        return {0: SimpleNamespace(outputs=outputs)}

    def _free_request(self, request: Any) -> None:
        del self.requests[request.request_id]

    def reset_prefix_cache(self) -> bool:
        return True


def REQUESTED(vllm_config: Any) -> bool:  # noqa: N802 (the adapter's routed_experts_requested, as the feature hands it)
    return True


@pytest.fixture
def scheduler(monkeypatch: pytest.MonkeyPatch) -> Scheduler:
    monkeypatch.setattr(engine, "selecting", set())
    monkeypatch.setattr(engine, "opted_out", set())
    hooked = type("HookedScheduler", (Scheduler,), {})
    hooked.add_request = engine._adding(Scheduler.add_request, REQUESTED)  # type: ignore[method-assign]
    hooked.update_from_output = engine._updating(Scheduler.update_from_output, REQUESTED)  # type: ignore[method-assign]
    hooked._free_request = engine._freeing(Scheduler._free_request, REQUESTED)  # type: ignore[method-assign]
    hooked.reset_prefix_cache = engine._resetting(Scheduler.reset_prefix_cache, REQUESTED)  # type: ignore[method-assign]
    instance = hooked()
    setattr(instance, engine._SCHEDULER_STATE, engine.EngineState(enabled=True))
    return instance


def step(scheduler: Scheduler, scheduled: list[str], new: list[str], finishing: list[str], version: int | None):
    scheduler_output = SimpleNamespace(
        scheduled=scheduled, finishing=set(finishing), scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new]
    )
    model_runner_output = SimpleNamespace()
    if version is not None:
        setattr(model_runner_output, weights.VERSION, version)
    return {o.request_id: o for o in scheduler.update_from_output(scheduler_output, model_runner_output)[0].outputs}


def test_opted_out_rows_never_leave_the_engine_core_and_its_first_row_is_past_the_prompt(scheduler: Scheduler) -> None:
    out, kept = request("out", 30, {"return_routed_experts": False}), request("kept", 30)
    original = out.sampling_params
    scheduler.add_request(out)
    scheduler.add_request(kept)
    first = step(scheduler, ["out", "kept"], ["out", "kept"], [], 1)
    assert scheduler.read_starts == {"out": 29, "kept": 0}  # vLLM reads one prompt row of the opted-out request
    assert original.routed_experts_prompt_start == 0  # the front end's object (in-process engines) is untouched
    assert first["out"].routed_experts is None and first["kept"].routed_experts is not None
    last = step(scheduler, ["out", "kept"], [], ["out", "kept"], 1)
    assert last["out"].routed_experts is None and last["out"].kv_transfer_params is None  # no rows, no record
    assert engine.RECORD_KEY in last["kept"].kv_transfer_params and not engine.opted_out


def test_omit_cached_starts_at_the_first_token_the_cache_did_not_serve(scheduler: Scheduler) -> None:
    scheduler.add_request(request("a", 40, {"routed_experts_omit": "cached"}, cached=32, start=5))
    scheduler.add_request(request("b", 40, {"routed_experts_omit": "cached"}, cached=0, start=5))
    step(scheduler, ["a", "b"], ["a", "b"], [], 1)
    assert scheduler.read_starts == {"a": 32, "b": 5}  # never before the caller's own prompt start
    records = step(scheduler, ["a", "b"], [], ["a", "b"], 1)
    a = records["a"].kv_transfer_params[engine.RECORD_KEY]
    assert a["first_token"] == 32 and a["cached"] == 0


def test_record_counts_cached_rows_and_the_versions_of_the_first_and_last_forward(scheduler: Scheduler) -> None:
    scheduler.add_request(request("r", 50, cached=16, start=4))
    step(scheduler, ["r"], ["r"], [], 1)  # its first forward on version 1
    step(scheduler, ["r"], [], [], 2)  # the weights were updated in between
    record = step(scheduler, ["r"], [], ["r"], 2)["r"].kv_transfer_params[engine.RECORD_KEY]
    assert record == {
        "first_token": 4,
        "cached": 12,  # tokens 4..15 served from the prefix cache
        "loaded": 0,
        "weight_version": {"first": 1, "last": 2, "cached_from": 1},  # cache filled since the first step
    }


def test_a_prefix_cache_reset_moves_cached_from_to_the_next_steps_version(scheduler: Scheduler) -> None:
    step(scheduler, [], [], [], 1)
    assert scheduler.reset_prefix_cache()
    scheduler.add_request(request("r", 20, cached=16))
    step(scheduler, ["r"], ["r"], [], 3)  # the update (1 -> 3) happened before the reset: nothing older is cached
    record = step(scheduler, ["r"], [], ["r"], 3)["r"].kv_transfer_params[engine.RECORD_KEY]
    assert record["weight_version"] == {"first": 3, "last": 3, "cached_from": 3}


@pytest.mark.parametrize(
    ("extra_args", "start", "first", "cached", "loaded"),
    [
        (None, 0, 0, 8, 12),  # tokens 0..7 from the local prefix cache, 8..19 loaded, 20.. computed here
        (None, 10, 10, 0, 10),  # rows from token 10: the loaded tokens 10..19 only
        ({"routed_experts_omit": "cached"}, 0, 8, 0, 12),  # the cached rows omitted, every loaded one returned
    ],
)
def test_loaded_rows_are_the_kv_connectors_hand_over(
    scheduler: Scheduler, extra_args: dict[str, Any] | None, start: int, first: int, cached: int, loaded: int
) -> None:
    """P/D: the record's ``loaded`` is what ``kv`` followed the connector load (tokens 8..19 here, after
    a local hit of 8), counted from the request's first row; those rows are not ``computed``."""
    r = request("r", 30, extra_args, cached=8, start=start)
    connector, carrier, _ = follow({"r": 12})
    carrier.stored["r"] = kv_rows(30)
    scheduler.add_request(r)
    assert connector.get_num_new_matched_tokens(r, 8) == (12, False)  # vLLM's scheduler: the local hit, then this
    connector.update_state_after_alloc(r, "blocks", 12)
    assert kv.loaded_span(r) == (8, 12)
    step(scheduler, ["r"], ["r"], [], 1)
    part = step(scheduler, ["r"], [], ["r"], 1)["r"].kv_transfer_params[engine.RECORD_KEY]
    assert (part["first_token"], part["cached"], part["loaded"]) == (first, cached, loaded)
    returned = np.zeros((30 + 4 - 1 - first, 3, 2), np.uint8)  # prompt 30, 4 tokens out: rows first..32
    record = provenance.complete(part, returned, "runner-output", "0.30.0")
    assert (record["computed"], record["cached"], record["loaded"]) == (len(returned) - cached - loaded, cached, loaded)


def test_a_request_nothing_was_loaded_for_has_no_loaded_rows(scheduler: Scheduler) -> None:
    r = request("r", 30, cached=8)
    connector, _, _ = follow({"r": 12})  # offered, but no rows beside that KV: declined, computed here
    scheduler.add_request(r)
    assert connector.get_num_new_matched_tokens(r, 8) == (0, False)
    connector.update_state_after_alloc(r, "blocks", 0)
    step(scheduler, ["r"], ["r"], [], 1)
    assert step(scheduler, ["r"], [], ["r"], 1)["r"].kv_transfer_params[engine.RECORD_KEY]["loaded"] == 0


def test_an_unstamped_step_has_an_unknown_version(scheduler: Scheduler) -> None:
    scheduler.add_request(request("r", 20))
    step(scheduler, ["r"], ["r"], [], None)  # an output that lost the attribute (e.g. copied on its way)
    record = step(scheduler, ["r"], [], ["r"], None)["r"].kv_transfer_params[engine.RECORD_KEY]
    assert record["weight_version"]["first"] is None and record["weight_version"]["last"] is None


def test_an_engine_without_routed_experts_is_left_alone(scheduler: Scheduler) -> None:
    setattr(scheduler, engine._SCHEDULER_STATE, engine.EngineState(enabled=False))
    scheduler.add_request(request("r", 20, {"return_routed_experts": False}))
    outputs = step(scheduler, ["r"], ["r"], ["r"], 1)
    assert not engine.opted_out and outputs["r"].kv_transfer_params is None
    assert outputs["r"].routed_experts is not None  # (such an engine has none; the hooks do not touch outputs)


def test_an_option_a_front_end_let_through_malformed_is_ignored_not_fatal(scheduler: Scheduler) -> None:
    scheduler.add_request(request("r", 20, {"return_routed_experts": "maybe"}))
    assert step(scheduler, ["r"], ["r"], ["r"], 1)["r"].routed_experts is not None
