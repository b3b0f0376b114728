# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.31+'s connector, scheduler side: a request's first row decided before the worker's emit start is
computed, and an opted-out request given an emit start the worker never reaches (no row of it emitted, read back
from the block store or shipped), with nothing to take."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_ascend_routing.compat.aux_output import requests as _aux_requests
from vllm_ascend_routing.output import engine


def request(request_id: str, extra_args: dict[str, Any] | None, cached: int = 0) -> Any:
    request = SimpleNamespace(
        request_id=request_id,
        sampling_params=SimpleNamespace(extra_args=extra_args, routed_experts_prompt_start=0),
        num_prompt_tokens=300,
        num_output_tokens=0,
        num_tokens=300,
        prefill_stats=SimpleNamespace(num_local_cached_tokens=cached),
    )
    engine.state_of(request).options = engine.options.of(request.sampling_params)
    return request


class Connector:
    """vLLM's AuxOutputSchedulerConnector as the hooks see it: the emit start from the prompt start (0.32's rule: the
    new token's once the request has output), and every scheduled request's rows to take."""

    def build_connector_meta(self, scheduler_output: Any, requests: dict[str, Any]) -> Any:
        def start(r: Any) -> int:
            prompt = min(r.sampling_params.routed_experts_prompt_start, r.num_prompt_tokens)
            return max(prompt, 0 if r.num_output_tokens == 0 else r.num_tokens - 1)

        return SimpleNamespace(requests={r: start(requests[r]) for r in scheduler_output.num_scheduled_tokens})

    def take_output(self, request: Any, output: dict[str, Any]) -> Any:
        return output[request.request_id]  # vLLM asserts the worker emitted the request's rows


@pytest.fixture
def connector(monkeypatch: pytest.MonkeyPatch) -> Connector:
    monkeypatch.setattr(engine, "selecting", {"out", "cached"})
    monkeypatch.setattr(engine, "opted_out", {"out"})
    hooked = type("Hooked", (Connector,), {})
    hooked.build_connector_meta = _aux_requests._building(Connector.build_connector_meta, engine.SELECTION)  # type: ignore[method-assign]
    hooked.take_output = _aux_requests._taking(Connector.take_output, engine.SELECTION)  # type: ignore[method-assign]
    return hooked()


def test_opted_out_requests_never_emit_and_have_nothing_to_take(connector: Connector) -> None:
    requests = {
        "out": request("out", {"return_routed_experts": False}),
        "cached": request("cached", {"routed_experts_omit": "cached"}, cached=256),
        "plain": request("plain", None, cached=256),
    }
    metadata = connector.build_connector_meta(
        SimpleNamespace(num_scheduled_tokens=dict.fromkeys(requests, 1)), requests
    )
    assert metadata.requests == {"out": _aux_requests.NEVER, "cached": 256, "plain": 0}
    assert connector.take_output(requests["out"], {}) is None  # the worker emitted nothing for it
    assert connector.take_output(requests["plain"], {"plain": "rows"}) == "rows"


def test_where_rows_follow_a_kv_connector_every_prompt_s_rows_reach_the_scheduler(connector: Connector) -> None:
    """A P/D prefill (or a stored prefix, an offload tier) of a request that opted out or asked for fewer rows: its
    prompt's rows go with the KV, so the worker emits them from its first prompt token, then each new token's (vLLM's
    start once it has output: the worker's cursor never moves back), and the scheduler takes them; vLLM gets them from
    the request's own first token on (the output layer drops an opted-out request's)."""
    _aux_requests.keep_prompt_rows(connector)
    out = request("out", {"return_routed_experts": False})
    cached = request("cached", {"routed_experts_omit": "cached"}, cached=256)
    requests = {"out": out, "cached": cached, "plain": request("plain", None)}
    scheduled = SimpleNamespace(num_scheduled_tokens=dict.fromkeys(requests, 1))
    assert connector.build_connector_meta(scheduled, requests).requests == {"out": 0, "cached": 0, "plain": 0}
    assert connector.take_output(out, {"out": "prompt rows"}) == "prompt rows"
    assert cached.sampling_params.routed_experts_prompt_start == 256  # its caller's first row stays decided
    rows = list(range(300))
    assert _aux_requests.from_first_token(cached, 0, rows) == rows[256:]
    assert _aux_requests.from_first_token(cached, 300, rows[:1]) == rows[:1]  # a later chunk: as taken
    out.num_output_tokens, out.num_tokens = 3, 303
    assert connector.build_connector_meta(scheduled, requests).requests["out"] == 302
