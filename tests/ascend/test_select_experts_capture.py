# SPDX-License-Identifier: Apache-2.0
"""Every vllm-ascend MoE method (unquantized and each quantized one) records the exact, logical ids its
real ``select_experts`` returned, once the layer is bound through the ``ascend`` backend."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import pytest
import torch

from tests.ascend.conftest import ASCEND_SRC, RoutingDone, no_forward_context, spy_selector
from vllm_ascend_routing.backends import ascend
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

NUM_TOKENS, NUM_LAYERS, TOP_K, NUM_EXPERTS, HIDDEN = 6, 4, 2, 8, 16
LAYER_ID = 2


def moe_method_classes() -> list[type]:
    """Unquantized + every quantized MoE method that routes with ``select_experts``, found in the source
    (so a method added by a new vllm-ascend release is tested without editing this file)."""
    if not ASCEND_SRC:
        return []
    found: list[type] = []
    packages = ["vllm_ascend.quantization.methods", "vllm_ascend._310p.quantization.methods"]
    modules = ["vllm_ascend.ops.fused_moe.fused_moe", "vllm_ascend._310p.fused_moe.fused_moe"]
    for package in packages:
        pkg = importlib.import_module(package)
        modules += [f"{package}.{info.name}" for info in pkgutil.iter_modules(pkg.__path__)]
    for name in modules:
        module = importlib.import_module(name)
        if not callable(getattr(module, "select_experts", None)):
            continue
        for cls in vars(module).values():
            if (
                isinstance(cls, type)
                and cls.__module__ == name
                and "moe" in cls.__name__.lower()
                and "apply" in vars(cls)
                and "select_experts" in inspect.getsource(cls.apply)
            ):
                found.append(cls)
    return found


METHODS = moe_method_classes()


def probe_instance(cls: type) -> Any:
    """``cls`` without its NPU-only ``__init__``; unset attributes read as ``None`` (feature flags off)."""
    probe = type(f"Probe{cls.__name__}", (cls,), {"__getattr__": lambda self, name: None})
    instance = object.__new__(probe)
    if isinstance(instance, torch.nn.Module):  # vLLM's MoE methods are CustomOps (modules)
        torch.nn.Module.__init__(instance)
    return instance


class FakeAscendMoE(torch.nn.Module):
    """The layer side of a vllm-ascend MoE: what ``apply`` reads, and a ``forward_impl`` that calls it."""

    def __init__(self, method: Any, mix_placement: bool = False) -> None:
        super().__init__()
        self.quant_method = method
        self.layer_name = f"model.layers.{LAYER_ID}.mlp.experts"
        self.layer_id = LAYER_ID
        self.top_k = TOP_K
        self.mix_placement = mix_placement
        self.n_shared_experts = 1 if mix_placement else 0
        self.log2phy = torch.randperm(NUM_EXPERTS, dtype=torch.int32)  # EPLB logical -> physical

    def forward_impl(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> Any:
        values = {
            "layer": self,
            "x": hidden_states,
            "router_logits": router_logits,
            "top_k": TOP_K,
            "renormalize": True,
            "use_grouped_topk": False,
            "num_experts": NUM_EXPERTS + self.n_shared_experts,
            "global_num_experts": NUM_EXPERTS + self.n_shared_experts,
            "log2phy": self.log2phy,
            "global_redundant_expert_num": 0,
            "scoring_func": "softmax",
            "routed_scaling_factor": 1.0,
            "enable_force_load_balance": False,
            "activation": "silu",
        }
        kwargs = {}
        for name, param in inspect.signature(self.quant_method.apply).parameters.items():
            if name in values:
                kwargs[name] = values[name]
            elif param.default is inspect.Parameter.empty and param.kind is param.POSITIONAL_OR_KEYWORD:
                kwargs[name] = None
        return self.quant_method.apply(**kwargs)


def bound_layer(cls: type, mix_placement: bool = False) -> tuple[FakeAscendMoE, torch.Tensor]:
    layer = FakeAscendMoE(probe_instance(cls), mix_placement)
    buffer = new_capture_buffer(NUM_TOKENS, NUM_LAYERS, TOP_K, NUM_EXPERTS, "cpu")
    capture = LayerCapture(buffer, LAYER_ID, NUM_EXPERTS, new_error_counter("cpu"))
    assert ascend.handles(layer)
    ascend.bind(layer, capture, layer.layer_name)
    return layer, buffer


def run_routing(monkeypatch: pytest.MonkeyPatch, layer: FakeAscendMoE, seed: int) -> torch.Tensor:
    """One forward of the bound layer; returns the ids ``select_experts`` returned."""
    module = importlib.import_module(type(layer.quant_method).__mro__[1].__module__)
    no_forward_context(monkeypatch, module)
    seen: list[torch.Tensor] = []
    spy_selector(monkeypatch, module, seen)  # outside the plugin's wrapper: sees exactly what it returned
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=generator)
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=generator)
    with pytest.raises(RoutingDone):
        layer.forward_impl(hidden, logits)
    (ids,) = seen
    return ids


def test_methods_are_found() -> None:
    names = {cls.__name__ for cls in METHODS}
    assert "AscendUnquantizedFusedMoEMethod" in names
    assert any("W8A8" in name for name in names), names  # at least one quantized method per release


@pytest.mark.parametrize("cls", METHODS, ids=lambda cls: f"{cls.__module__.split('.')[-1]}.{cls.__name__}")
def test_apply_records_the_ids_select_experts_returned(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    layer, buffer = bound_layer(cls)
    ids = run_routing(monkeypatch, layer, seed=len(cls.__name__))
    assert ids.dtype == torch.int32 and ids.shape == (NUM_TOKENS, TOP_K)
    assert torch.equal(buffer[:, LAYER_ID].to(torch.int32), ids)  # exact, in vLLM's order
    others = [layer_id for layer_id in range(NUM_LAYERS) if layer_id != LAYER_ID]
    assert (buffer[:, others] == 0).all()  # the layer id comes from the layer
    physical = layer.log2phy[ids.long()]
    assert not torch.equal(physical, ids)  # the permutation moves some id, so this tells them apart
    assert not torch.equal(buffer[:, LAYER_ID].to(torch.int32), physical)


def test_mix_placement_keeps_the_routed_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """With mix_placement, select_experts appends the shared expert's id as an extra column."""
    candidates = [cls for cls in METHODS if "mix_placement" in inspect.getsource(cls.apply)]
    if not candidates:
        pytest.skip("no MoE method of this vllm-ascend release supports mix_placement")
    layer, buffer = bound_layer(candidates[0], mix_placement=True)
    ids = run_routing(monkeypatch, layer, seed=7)
    assert ids.shape == (NUM_TOKENS, TOP_K + 1)
    assert (ids[:, TOP_K] == NUM_EXPERTS).all()  # the shared expert, after the routed ones
    assert torch.equal(buffer[:, LAYER_ID].to(torch.int32), ids[:, :TOP_K])


def test_a_forward_without_select_experts_fails_loudly() -> None:
    cls = next(cls for cls in METHODS if cls.__name__ == "AscendUnquantizedFusedMoEMethod")
    layer, buffer = bound_layer(cls)
    layer.quant_method.apply = lambda **kwargs: None  # e.g. a fused gating kernel that skips it
    with pytest.raises(ascend.RoutingNotRecordedError, match="without calling select_experts"):
        layer.forward_impl(torch.zeros(NUM_TOKENS, HIDDEN), torch.zeros(NUM_TOKENS, NUM_EXPERTS))
    assert (buffer == 0).all()


def test_recording_adds_one_op_and_no_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting, not timing: besides vllm-ascend's own routing ops, one record_topk_ids per layer."""
    from tests.test_hot_path import SYNCING, OpLog

    cls = next(cls for cls in METHODS if cls.__name__ == "AscendUnquantizedFusedMoEMethod")
    module = importlib.import_module(cls.__module__)
    no_forward_context(monkeypatch, module)
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=generator)
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=generator)

    def routing_ops(bound: bool) -> list[str]:
        layer = bound_layer(cls)[0] if bound else FakeAscendMoE(probe_instance(cls))
        seen: list[torch.Tensor] = []
        with monkeypatch.context() as patch:
            spy_selector(patch, module, seen)
            with OpLog() as log, pytest.raises(RoutingDone):
                layer.forward_impl(hidden, logits)
        return log.ops

    unbound, bound = routing_ops(bound=False), routing_ops(bound=True)
    added = list(bound)
    for op in unbound:
        added.remove(op)
    assert added == ["vllm_ascend_routing::record_topk_ids"]
    assert not {op.split("::")[1] for op in added} & SYNCING
