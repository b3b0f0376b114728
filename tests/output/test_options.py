# SPDX-License-Identifier: Apache-2.0
"""Per-request routed-experts options as callers write them (SamplingParams.extra_args, HTTP vllm_xargs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ascend_routing.output import options
from vllm_ascend_routing.output.options import RequestOptions


@pytest.mark.parametrize(
    ("extra_args", "expected"),
    [
        (None, options.NONE),
        ({}, options.NONE),
        ({"other": 1}, options.NONE),
        ({"return_routed_experts": False}, RequestOptions(returns=False)),
        ({"return_routed_experts": 0}, RequestOptions(returns=False)),  # JSON false through vllm_xargs' int
        ({"return_routed_experts": "false"}, RequestOptions(returns=False)),
        ({"return_routed_experts": True}, RequestOptions(returns=True)),
        ({"return_routed_experts": "1"}, RequestOptions(returns=True)),
        ({"routed_experts_omit": "cached"}, RequestOptions(omit_cached=True)),
        ({"routed_experts_omit": 12}, RequestOptions(omit_before=12)),
        ({"routed_experts_omit": "12"}, RequestOptions(omit_before=12)),
        ({"routed_experts_omit": 0, "return_routed_experts": True}, RequestOptions(returns=True)),
    ],
)
def test_parse(extra_args: dict[str, object] | None, expected: RequestOptions) -> None:
    assert options.parse(extra_args) == expected


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        ({"return_routed_experts": "maybe"}, "return_routed_experts='maybe': expected true or false"),
        ({"return_routed_experts": 0.0}, "expected true or false"),
        ({"return_routed_experts": 2}, "expected true or false"),
        ({"routed_experts_omit": -3}, "expected 'cached'"),
        ({"routed_experts_omit": True}, "expected 'cached'"),
        ({"routed_experts_omit": "prefix"}, "expected 'cached'"),
        ({"routed_experts_omit": 1.5}, "expected 'cached'"),
    ],
)
def test_malformed_options_are_refused_naming_the_key(extra_args: dict[str, object], message: str) -> None:
    with pytest.raises(options.RequestOptionError, match=message):
        options.parse(extra_args)
    assert issubclass(options.RequestOptionError, ValueError)  # vLLM's server answers a ValueError with HTTP 400


def test_what_the_engine_core_acts_on() -> None:
    assert RequestOptions(returns=False).opted_out and RequestOptions(returns=False).selects_rows
    assert RequestOptions(omit_cached=True).selects_rows and not RequestOptions(omit_cached=True).opted_out
    # a token to start from is applied in the front end (routed_experts_prompt_start): nothing for the engine core
    assert not RequestOptions(omit_before=5).selects_rows and not RequestOptions(returns=True).selects_rows


def test_of_reads_sampling_params_and_ignores_pooling() -> None:
    assert options.of(SimpleNamespace(extra_args={"return_routed_experts": False})).opted_out
    assert options.of(SimpleNamespace()) is options.NONE  # PoolingParams has no extra_args for this
    assert options.of(None) is options.NONE
