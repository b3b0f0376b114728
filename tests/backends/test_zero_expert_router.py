# SPDX-License-Identifier: Apache-2.0
"""vLLM's real ``ZeroExpertRouter`` (LongCat-Flash): zero experts are recorded as their own ids, where vLLM's own
capture hook sees them overwritten with expert 0. Its two GPU kernels (``fused_topk_bias``'s top-k,
``zero_experts_compute_triton``) are replaced by CPU stand-ins; the router's masking and ``BaseRouter``'s order
(routing, then the capture hook) are vLLM's code of the installed release."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch

from vllm_ascend_routing.backends import zero_expert_router
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter

pytestmark = pytest.mark.vllm

E, Z, K = 8, 4, 3


@pytest.fixture
def router(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = importlib.import_module(zero_expert_router._MODULE)

    def topk_bias(hidden_states: Any, gating_output: torch.Tensor, scoring_func: str, e_score_correction_bias: Any,
                  topk: int, renormalize: bool, indices_type: Any = None, **_: Any) -> Any:  # fmt: skip
        weights, ids = torch.topk(gating_output.softmax(dim=-1) + e_score_correction_bias, topk, dim=-1)
        return weights, ids.to(indices_type or torch.int32)

    monkeypatch.setattr(module, "fused_topk_bias", topk_bias)
    monkeypatch.setattr(module, "zero_experts_compute_triton", lambda **kw: torch.zeros_like(kw["hidden_states"]))
    options: dict[str, Any] = {
        "top_k": K,
        "global_num_experts": E,
        "e_score_correction_bias": torch.zeros(E + Z),
        "num_logical_experts": E,
        "zero_expert_type": "identity",
    }
    if "eplb_state" in inspect.signature(module.ZeroExpertRouter).parameters:  # a parameter up to 0.2x: no EPLB
        options["eplb_state"] = None
    return module.ZeroExpertRouter(**options)


def _layer(router: Any) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.router = router
    return layer


def _logits() -> torch.Tensor:
    logits = torch.full((3, E + Z), -5.0)
    logits[0, [E, E + 1, E + 3]] = torch.tensor([3.0, 2.0, 1.0])  # only zero experts: vLLM returns [0, 0, 0]
    logits[1, [0, E + 2, 5]] = torch.tensor([3.0, 2.0, 1.0])  # expert 0 and a zero expert: vLLM returns 0 twice
    logits[2, [1, 2, 3]] = torch.tensor([3.0, 2.0, 1.0])
    return logits


def test_zero_experts_are_recorded_as_their_own_ids(router: Any) -> None:
    layer = _layer(router)
    assert zero_expert_router.handles(layer) and zero_expert_router.zero_experts(layer) == Z
    buffer, errors = new_capture_buffer(4, 1, K, E + Z, "cpu"), new_error_counter("cpu")
    zero_expert_router.bind(layer, LayerCapture(buffer, 0, E + Z, errors), "layers.0.mlp.experts")
    _, ids = router.select_experts(torch.zeros(3, 4), _logits())
    assert buffer[:3, 0].tolist() == [[E, E + 1, E + 3], [0, E + 2, 5], [1, 2, 3]]
    assert int(errors) == 0
    assert ids.tolist() == [[0, 0, 0], [0, 0, 5], [1, 2, 3]]  # what vLLM computes with (and its hook would see)


def test_a_router_that_stops_passing_its_ids_raises(router: Any) -> None:
    layer = _layer(router)
    compute = router._compute_routing

    def bypassing(*args: Any, **kwargs: Any) -> Any:
        with pytest.MonkeyPatch.context() as patch:  # vLLM's routing, with the zero experts' kernel skipped
            patch.setattr(router, "_compute_routing", compute)
            module = importlib.import_module(zero_expert_router._MODULE)
            patch.setattr(module, "zero_experts_compute_triton", lambda **kw: None)
            return compute(*args, **kwargs)

    router._compute_routing = bypassing
    buffer = new_capture_buffer(4, 1, K, E + Z, "cpu")
    zero_expert_router.bind(layer, LayerCapture(buffer, 0, E + Z, new_error_counter("cpu")), "layers.0.mlp.experts")
    with pytest.raises(RuntimeError, match="without passing its ids to zero_experts_compute_triton"):
        router.select_experts(torch.zeros(3, 4), _logits())
