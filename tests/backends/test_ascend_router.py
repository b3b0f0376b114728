# SPDX-License-Identifier: Apache-2.0
"""Backend ``ascend_router`` with a stand-in of vllm-ascend's router design (a module named like
vllm-ascend's, compiled here): which layers it claims, its bind-time bytecode checks, the forward guard.
The real classes are covered on vllm-ascend's source in ``tests/ascend``."""

from __future__ import annotations

import sys
import textwrap
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm_ascend_routing.backends import BACKENDS, ascend, ascend_router
from vllm_ascend_routing.backends._recorded import RoutingNotRecordedError
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter

_SOURCE = """
import torch


class BaseRouter:  # vLLM's template: compute, capture logical ids, then map (EPLB)
    def __init__(self):
        self.capture_fn = None

    def set_capture_fn(self, fn):
        self.capture_fn = fn

    def _select_experts(self, hidden_states, router_logits):
        weights, ids = torch.softmax(router_logits, -1).topk(2, dim=-1)
        if self.capture_fn is not None:
            self.capture_fn(ids)
        return weights, ids


class OwnTemplateRouter(BaseRouter):  # overrides the template: never calls capture_fn
    def _select_experts(self, hidden_states, router_logits):
        return torch.softmax(router_logits, -1).topk(2, dim=-1)


class AscendRoutedExperts(torch.nn.Module):
    def __init__(self, router):
        super().__init__()
        self.router = router
        self.layer_name = "model.layers.1.mlp.experts"
        self.log2phy = torch.tensor([3, 2, 1, 0, 7, 6, 5, 4])
        self.dispatched = None

    def _select_experts(self, hidden_states, router_logits):
        weights, ids = self.router._select_experts(hidden_states, router_logits)
        return weights, self.log2phy[ids]

    def forward_impl(self, *, hidden_states, router_logits):
        _, self.dispatched = self._select_experts(hidden_states, router_logits)
        return hidden_states


class AscendMoERunner(torch.nn.Module):
    def __init__(self, routed_experts):
        super().__init__()
        self.routed_experts = routed_experts
        self.router = routed_experts.router
        self.layer_name = routed_experts.layer_name

    def forward(self, hidden_states, router_logits):
        return self.routed_experts.forward_impl(hidden_states=hidden_states, router_logits=router_logits)
"""


@pytest.fixture
def design() -> Iterator[types.ModuleType]:
    """The stand-in, as a module of a package named ``vllm_ascend`` (what the backend recognises)."""
    package, name = types.ModuleType("vllm_ascend"), "vllm_ascend.ops.fused_moe.routed_experts"
    module = types.ModuleType(name)
    exec(compile(textwrap.dedent(_SOURCE), name, "exec"), vars(module))  # noqa: S102 (test-only source above)
    saved = {key: sys.modules.get(key) for key in ("vllm_ascend", name)}
    sys.modules.update({"vllm_ascend": package, name: module})
    yield module
    for key, value in saved.items():
        if value is None:
            sys.modules.pop(key, None)
        else:
            sys.modules[key] = value


def layer(design: types.ModuleType, router_cls: str = "BaseRouter") -> Any:
    return design.AscendMoERunner(design.AscendRoutedExperts(getattr(design, router_cls)()))


def bind(module: Any) -> torch.Tensor:
    buffer = new_capture_buffer(4, 3, 2, 8, "cpu")
    ascend_router.bind(module, LayerCapture(buffer, 1, 8, new_error_counter("cpu")), module.layer_name)
    return buffer


def test_the_router_design_is_claimed_by_ascend_router_only(design: types.ModuleType) -> None:
    runner = layer(design)
    assert ascend_router.handles(runner) and not ascend.handles(runner)
    assert next(name for name, backend in BACKENDS if backend.handles(runner)) == "ascend_router"


def test_logical_ids_are_recorded_before_log2phy(design: types.ModuleType) -> None:
    runner = layer(design)
    buffer = bind(runner)
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0], [5.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0]])
    runner(torch.zeros(2, 4), logits)
    assert buffer[:2, 1].tolist() == [[1, 7], [0, 3]]
    assert runner.routed_experts.dispatched.tolist() == [[2, 4], [3, 0]]  # physical: what the experts got


def test_a_router_that_overrides_the_template_is_refused(design: types.ModuleType) -> None:
    with pytest.raises(RoutingNotRecordedError, match="OwnTemplateRouter's _select_experts never calls capture_fn"):
        bind(layer(design, "OwnTemplateRouter"))


def test_a_forward_that_bypasses_the_router_raises(design: types.ModuleType) -> None:
    runner = layer(design)
    buffer = bind(runner)
    runner.routed_experts._select_experts = lambda hidden_states, router_logits: (None, router_logits.topk(2)[1])
    with pytest.raises(RoutingNotRecordedError, match="without reaching BaseRouter's capture_fn"):
        runner(torch.zeros(1, 4), torch.randn(1, 8))
    assert (buffer == 0).all()


def test_rebinding_replaces_the_hook_and_the_guard(design: types.ModuleType) -> None:
    runner = layer(design)
    first, second = bind(runner), bind(runner)
    runner(torch.zeros(1, 4), torch.tensor([[9.0, 0, 0, 0, 0, 0, 0, 8.0]]))
    assert second[0, 1].tolist() == [0, 7] and (first == 0).all()


def test_a_vllm_ascend_layer_no_ascend_backend_knows_is_refused_not_left_to_the_router(
    design: types.ModuleType,
) -> None:
    """A future vllm-ascend MoE class whose routing the plugin does not know (here: its routed experts route
    without a ``_select_experts``) is refused by name; vLLM's router hook, which it may never call, does not
    take it (rows would stay zero)."""
    from vllm_ascend_routing.backends import UnboundLayerError, bind_model, router

    runner = layer(design)
    del type(runner.routed_experts)._select_experts
    runner.layer_id = 1  # what vLLM's layers carry (the id is otherwise read from the layer name, with vLLM)
    assert not ascend_router.handles(runner) and not router.handles(runner)
    model = torch.nn.Module()
    model.layer = runner
    buffer = new_capture_buffer(4, 3, 2, 8, "cpu")
    with pytest.raises(UnboundLayerError, match="no capture backend"):
        bind_model(model, lambda layer_id, zero_experts: LayerCapture(buffer, layer_id, 8, new_error_counter("cpu")))
