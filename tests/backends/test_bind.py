# SPDX-License-Identifier: Apache-2.0
"""Binding target-model MoE layers through each backend, with fake vLLM layers."""

from __future__ import annotations

import pytest
import torch

from tests.fakes import FakeModel
from vllm_ascend_routing import backends
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter


def bind(model: torch.nn.Module, num_experts: int = 8) -> torch.Tensor:
    buffer = new_capture_buffer(4, 3, 2, num_experts, "cpu")
    errors = new_error_counter("cpu")
    backends.bind_model(model, lambda layer_id, zero_experts: LayerCapture(buffer, layer_id, num_experts, errors))
    return buffer


def test_router_backend_records_logical_ids_per_layer() -> None:
    model = FakeModel(cpu=False)
    buffer = bind(model)
    model.layers[0].router.capture_fn(torch.tensor([[1, 5], [2, 3]], dtype=torch.int32))
    model.layers[2].router.capture_fn(torch.tensor([[7, 0]], dtype=torch.int64))
    assert buffer[:2, 0].tolist() == [[1, 5], [2, 3]]
    assert buffer[:1, 2].tolist() == [[7, 0]]
    assert (buffer[:, 1] == 0).all()  # the dense layer's rows stay zero


def test_cpu_moe_backend_wraps_forward_method() -> None:
    model = FakeModel(cpu=True)
    buffer = bind(model)
    impl = model.layers[2].quant_method.cpu_fused_moe
    x = torch.zeros(3, 2)
    y = impl.forward_method(model.layers[2], x, torch.ones(3, 2), torch.tensor([[4, 1], [0, 6], [3, 3]]))
    assert torch.equal(y, x + 1) and impl.calls == 1
    assert buffer[:3, 2].tolist() == [[4, 1], [0, 6], [3, 3]]
    assert model.layers[2].router.capture_fn is None  # the router is bypassed, so not used


def test_rebinding_replaces_instead_of_stacking() -> None:
    model = FakeModel(cpu=True)
    first = bind(model)
    second = bind(model)
    impl = model.layers[0].quant_method.cpu_fused_moe
    impl.forward_method(model.layers[0], torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[2, 3]]))
    assert impl.calls == 1
    assert second[0, 0].tolist() == [2, 3] and first[0, 0].tolist() == [0, 0]


def test_out_of_range_ids_are_marked_not_wrapped() -> None:
    model = FakeModel(cpu=False)
    buffer = bind(model, num_experts=8)
    model.layers[0].router.capture_fn(torch.tensor([[8, -3]], dtype=torch.int32))
    assert buffer[0, 0].tolist() == [-1, -1]


def test_draft_layers_outside_target_model_are_not_bound() -> None:
    target, draft = FakeModel(cpu=False), FakeModel(cpu=False)
    bind(target)
    assert draft.layers[0].router.capture_fn is None


def test_shared_router_is_bound_once() -> None:
    model = FakeModel(cpu=False)
    runner = torch.nn.Module()
    runner.layer_name = "model.layers.0.mlp.experts"  # type: ignore[assignment]
    runner.router = model.layers[0].router  # type: ignore[assignment]
    model.layers[0].add_module("runner", runner)
    calls: list[int] = []
    backends.bind_model(
        model,
        lambda layer_id, zero_experts: (
            calls.append(layer_id)
            or LayerCapture(new_capture_buffer(1, 3, 2, 8, "cpu"), layer_id, 8, new_error_counter("cpu"))
        ),
    )
    assert calls == [0, 2]


def test_unroutable_layer_is_refused() -> None:
    model = FakeModel(cpu=False)
    model.layers[2].router = object()  # no capture hook, no CPU MoE
    with pytest.raises(backends.UnboundLayerError, match="model.layers.2|layers.2"):
        bind(model)


def test_model_without_moe_is_refused() -> None:
    with pytest.raises(backends.UnboundLayerError, match="No MoE layer"):
        bind(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_sgl_kernel_without_forward_method_is_refused() -> None:
    model = FakeModel(cpu=True)
    del model.layers[0].quant_method.cpu_fused_moe.forward_method
    with pytest.raises(RuntimeError, match="VLLM_CPU_SGL_KERNEL"):
        bind(model)


def test_too_many_experts_for_storage_is_refused() -> None:
    with pytest.raises(ValueError, match="40000 expert ids"):
        new_capture_buffer(1, 1, 1, 40000, "cpu")


@pytest.mark.parametrize(
    ("model", "backend"),
    [
        (FakeModel(cpu=False), "router"),
        (FakeModel(cpu=True), "cpu_moe"),
        (FakeModel(cpu=False, cpu_experts=True), "cpu_experts"),
    ],
)
def test_bind_model_reports_the_backend_of_each_layer(model: FakeModel, backend: str) -> None:
    # The count per backend goes into the start-up log line: which interception serves a model is a fact
    # users and the compatibility notes need, not a guess.
    buffer = new_capture_buffer(4, 3, 2, 8, "cpu")
    errors = new_error_counter("cpu")
    bound = backends.bind_model(model, lambda layer_id, zero_experts: LayerCapture(buffer, layer_id, 8, errors))
    assert bound == {backend: 2}  # layers 0 and 2; layer 1 is dense


def test_cpu_experts_backend_records_what_the_kernel_routes_with() -> None:
    model = FakeModel(cpu=False, cpu_experts=True)
    buffer = bind(model)
    experts = model.layers[2].quant_method.moe_kernel.fused_experts
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.0], [0.7, 0.2, 0.1, 0.8], [0.3, 0.2, 0.6, 0.9]])
    out = experts.apply(torch.zeros(3, 1), logits)
    assert torch.equal(out, torch.tensor([[3.0], [3.0], [5.0]])) and experts.calls == 1  # forward unchanged
    assert buffer[:3, 2].tolist() == [[1, 2], [3, 0], [3, 2]]
    assert (buffer[:, 0] == 0).all()  # another layer's experts object: not touched by layer 2's forward
    assert model.layers[2].router.capture_fn is None  # the router is bypassed, so not used
    bind(model)  # rebinding replaces the wrapper instead of stacking
    experts.apply(torch.zeros(1, 1), logits[:1])
    assert experts.calls == 2


def test_cpu_experts_shared_by_two_layers_is_refused() -> None:
    model = FakeModel(cpu=False, cpu_experts=True)
    model.layers[2].quant_method.moe_kernel = model.layers[0].quant_method.moe_kernel
    with pytest.raises(RuntimeError, match="shared by two MoE layers"):
        bind(model)


class FakeCaptureSource(torch.nn.Module):
    """A module vLLM's binder binds by its own ``capture_fn`` (``RoutedExpertsCaptureSource``, vLLM 0.28+)."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.capture_fn = None


def test_capture_sources_outside_the_bound_layers_are_left_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second step: a capture source inside a bound MoE layer is that layer's, one on a layer id a backend
    records is that backend's, any other is left to vLLM's binder (or refused without one)."""
    from vllm_ascend_routing.backends import upstream

    # vLLM's protocol check needs vLLM: here a capture source is this class (the rest is bind_model's own).
    monkeypatch.setattr(upstream, "is_capture_source", lambda module: isinstance(module, FakeCaptureSource))
    monkeypatch.setattr(upstream, "defers", lambda module: isinstance(module, FakeCaptureSource))
    model = FakeModel(cpu=False, moe_layers=(0, 2), num_layers=3)
    model.layers[0].inner = FakeCaptureSource(4)  # inside a bound layer: never bound apart
    model.layers[1] = FakeCaptureSource(1)  # its own layer: vLLM's
    model.extra = FakeCaptureSource(2)  # layer 2's routing is recorded by the router backend already
    buffer = new_capture_buffer(4, 3, 2, 8, "cpu")
    errors = new_error_counter("cpu")
    deferred: list[tuple[int, torch.nn.Module]] = []
    make = lambda layer_id, zero_experts: LayerCapture(buffer, layer_id, 8, errors)  # noqa: E731
    bound = backends.bind_model(model, make, lambda layer_id, module: deferred.append((layer_id, module)))
    assert bound == {"router": 2, "vllm": 1}
    assert deferred == [(1, model.layers[1])]
    alone = FakeModel(cpu=False, moe_layers=(0, 2), num_layers=3)
    alone.layers[1] = FakeCaptureSource(1)
    with pytest.raises(backends.UnboundLayerError, match="RoutedExpertsCaptureSource"):
        backends.bind_model(alone, make)  # no binder to leave it to: refused, never zeros


@pytest.mark.parametrize("kind", ["cpu_moe", "cpu_experts"])
def test_a_layer_stays_bound_when_its_weights_are_processed_again(kind: str) -> None:
    # vLLM's reload_weights (and weight syncs ending in process_weights_after_loading) rebuild the CPU MoE's
    # kernel objects: the wrapper installed on the old ones would be gone and every later row zero.
    model = FakeModel(cpu=kind == "cpu_moe", cpu_experts=kind == "cpu_experts")
    buffer = bind(model)
    layer = model.layers[2]
    for _ in range(2):  # two weight updates: bound again each time, never stacked
        layer.quant_method.process_weights_after_loading(layer)
    assert layer.quant_method.processed == 3
    if kind == "cpu_moe":
        impl = layer.quant_method.cpu_fused_moe
        impl.forward_method(layer, torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([[4, 1], [0, 6]]))
        assert impl.calls == 1
        assert buffer[:2, 2].tolist() == [[4, 1], [0, 6]]
    else:
        experts = layer.quant_method.moe_kernel.fused_experts
        experts.apply(torch.zeros(1, 1), torch.tensor([[0.1, 0.9, 0.5, 0.0]]))
        assert experts.calls == 1
        assert buffer[:1, 2].tolist() == [[1, 2]]
