# SPDX-License-Identifier: Apache-2.0
"""vllm-ascend's real MoE layer, run on the CPU: ``AscendFusedMoE.forward_impl`` through its
``AscendMoERunner``, the real quant method's ``apply`` to its end, ``select_experts`` on its native torch
path, the real flash-comm3 (gate) context. Only the device communication is a stand-in
(``StubCommMethod``: prepare / fused_experts / finalize, which on an NPU dispatch tokens to experts), and
the forward context is a plain namespace holding the attributes vllm-ascend reads from it.

Objects are built without their NPU-only ``__init__``: attributes ``__init__`` would set are set here,
every other attribute reads as ``None`` (feature flags off).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

FUSED_MOE = "vllm_ascend.ops.fused_moe.fused_moe"
SELECTOR = "vllm_ascend.ops.fused_moe.experts_selector"
FORWARD_CONTEXT = "vllm_ascend.ascend_forward_context"
FLASH_COMMON3 = "vllm_ascend.flash_common3_context"


def _read_unset_as_none(self: Any, name: str) -> Any:
    if isinstance(self, torch.nn.Module):  # parameters, buffers and submodules live in nn.Module's dicts
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            pass
    return None


_WEIGHT_WORDS = ("weight", "scale", "bias", "offset")


def _read_unset_weight_as_empty(self: Any, name: str) -> Any:
    """A layer's unloaded weights are empty tensors (only the stubbed expert computation reads them)."""
    value = _read_unset_as_none(self, name)
    if value is None and any(word in name for word in _WEIGHT_WORDS):
        return torch.empty(0)
    return value


def probe_instance(cls: type, *, weights: bool = False) -> Any:
    """``cls`` without its NPU-only ``__init__``; unset attributes read as ``None`` (feature flags off),
    or, with ``weights`` (a layer), unset weight-like attributes as empty tensors."""
    read_unset = _read_unset_weight_as_empty if weights else _read_unset_as_none
    probe = type(f"Probe{cls.__name__}", (cls,), {"__getattr__": read_unset})
    instance = object.__new__(probe)
    if isinstance(instance, torch.nn.Module):  # vLLM's MoE methods are CustomOps (modules)
        torch.nn.Module.__init__(instance)
    return instance


def reference_top_k(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ids a softmax router picks, computed here independently of vllm-ascend: descending top-k."""
    return torch.softmax(router_logits.float(), dim=-1).topk(top_k, dim=-1).indices


@dataclass
class StubCommMethod:
    """The device communication of vllm-ascend's MoE (all-gather / MC2 / all-to-all), on one CPU rank:
    ``prepare`` and ``finalize`` pass tokens through; ``fused_experts`` keeps what ``apply`` handed it
    (the ids it dispatches on and the EPLB ``log2phy`` map the dispatcher applies) and returns the input."""

    dispatched: list[dict[str, Any]] = field(default_factory=list)

    def prepare(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, **_: Any) -> Any:
        return SimpleNamespace(
            hidden_states=hidden_states,
            router_logits=router_logits,
            mc2_mask=None,
            padded_hidden_states_shape=None,
            pertoken_scale=None,
        )

    def fused_experts(self, fused_experts_input: Any = None, **kwargs: Any) -> Any:
        given = fused_experts_input if fused_experts_input is not None else SimpleNamespace(**kwargs)
        topk_ids = _find(given, "topk_ids")
        self.dispatched.append({"topk_ids": topk_ids.clone(), "log2phy": _find(given, "log2phy")})
        return self.result(_find(given, "hidden_states"))

    @staticmethod
    def result(hidden_states: torch.Tensor) -> Any:
        """What vllm-ascend's fused_experts returns, with the input as the experts' output."""
        result_cls = getattr(importlib.import_module(FUSED_MOE), "FusedExpertsResult", None)
        return hidden_states.clone() if result_cls is None else result_cls(routed_out=hidden_states.clone())

    def finalize(self, hidden_states: torch.Tensor, **_: Any) -> torch.Tensor:
        return hidden_states


def _find(container: Any, name: str) -> Any:
    """An attribute of vllm-ascend's fused-experts input, wherever its release nests it."""
    if hasattr(container, name):
        return getattr(container, name)
    for part in dataclasses.fields(container) if dataclasses.is_dataclass(container) else ():
        value = getattr(container, part.name)
        if hasattr(value, name):
            return getattr(value, name)
    raise AssertionError(f"fused_experts input has no {name}: {container!r}")


NUM_EXPERTS, TOP_K, HIDDEN = 8, 2, 16


@dataclass
class RealMoE:
    """One real ``AscendFusedMoE`` with a real quant method, and the stand-ins around it."""

    layer: torch.nn.Module
    runner: Any
    comm: StubCommMethod
    layer_id: int

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> Any:
        """What vLLM's ``moe_forward`` op runs: the MoE runner's ``forward_impl`` on the layer."""
        return self.runner.forward_impl(self.layer, hidden_states, router_logits, None)


def build(
    monkeypatch: pytest.MonkeyPatch,
    method: Any,
    *,
    layer_id: int = 2,
    gate: bool = False,
    layer_cls: type | None = None,
    profile_run: bool = False,
) -> RealMoE:
    """A real ``AscendFusedMoE`` (``multistream_overlap_gate`` = ``gate``) around ``method``."""
    fused_moe = importlib.import_module(FUSED_MOE)
    cls = layer_cls or fused_moe.AscendFusedMoE
    layer = probe_instance(cls, weights=True)
    generator = torch.Generator().manual_seed(layer_id)
    attributes: dict[str, Any] = {
        "quant_method": method,
        "layer_name": f"model.layers.{layer_id}.mlp.experts",
        "layer_id": layer_id,
        "top_k": TOP_K,
        "use_grouped_topk": False,
        "renormalize": True,
        "topk_group": None,
        "num_expert_group": None,
        "custom_routing_function": None,
        "scoring_func": "softmax",
        "_original_routed_scaling_factor": 1.0,
        "routed_scaling_factor": 1.0,
        "e_score_correction_bias": None,
        "moe_config": SimpleNamespace(num_experts=NUM_EXPERTS, has_bias=False),
        "tid2eid": None,
        "activation": "silu",
        "apply_router_weight_on_input": False,
        "_expert_map": None,
        # EPLB's logical -> physical map: a permutation that moves ids, so physical ids differ from logical.
        "log2phy": torch.randperm(NUM_EXPERTS, generator=generator).to(torch.int32),
        "global_redundant_expert_num": 0,
        "dynamic_eplb": False,
        "multistream_overlap_gate": gate,
        "enable_shared_expert_dp": False,
        "quant_type": None,
        "enable_npugraph_ex_static_kernel": False,
        "swiglu_limit": 0.0,
        "n_shared_experts": 0,
        "zero_expert_num": 0,
        "zero_expert_type": None,
        # routed experts on: vllm-ascend's own capture branch runs (and finds no capturer: the plugin's binder
        # replaced the one that would set it)
        "vllm_config": SimpleNamespace(model_config=SimpleNamespace(enable_return_routed_experts=True)),
    }
    for name, value in attributes.items():
        if not isinstance(getattr(cls, name, None), property):  # e.g. layer_id: derived from layer_name
            setattr(layer, name, value)
    method_attributes = {
        "moe": SimpleNamespace(has_bias=False),
        "multistream_overlap_gate": gate,
        "dynamic_eplb": False,
        "in_dtype": torch.float32,
        "tid2eid": None,
    }
    wrapped = method
    while wrapped is not None:  # the adapter, and the scheme it delegates to
        for name, value in method_attributes.items():
            if not isinstance(getattr(type(wrapped), name, None), property):
                object.__setattr__(wrapped, name, value)
        wrapped = vars(wrapped).get("quant_method")
    runner = object.__new__(fused_moe.AscendMoERunner)
    object.__setattr__(runner, "_shared_experts", None)  # read through MoERunner.shared_experts
    object.__setattr__(layer, "runner", runner)
    comm = StubCommMethod()
    _forward_context(monkeypatch, comm, gate, profile_run)
    return RealMoE(layer, runner, comm, layer_id)


def _forward_context(monkeypatch: pytest.MonkeyPatch, comm: StubCommMethod, gate: bool, profile_run: bool) -> None:
    forward_context = importlib.import_module(FORWARD_CONTEXT)
    context = SimpleNamespace(
        moe_comm_method=comm,
        moe_comm_type=forward_context.MoECommType.ALLGATHER,
        in_profile_run=profile_run,
        flash_comm_v1_enabled=False,
        input_ids=None,
        all_moe_layers=None,
        moe_layer_index=0,
        eplb_heat_collection_status=False,
    )
    # vLLM's own forward context, which vllm-ascend's _EXTRA_CTX proxy and get_forward_context read.
    monkeypatch.setattr(importlib.import_module("vllm.forward_context"), "_forward_context", context)
    selector = importlib.import_module(SELECTOR)
    monkeypatch.setattr(selector, "check_npu_moe_gating_top_k", lambda *a, **k: False)  # native torch path
    monkeypatch.setattr(selector, "get_weight_prefetch_method", lambda: None)
    flash_common3 = importlib.import_module(FLASH_COMMON3)
    monkeypatch.setattr(flash_common3, "_flash_common3_context", None)
    if gate:  # what vllm-ascend's model sets before the MoE runs: the shared experts the gate stream runs
        flash_common3.set_flash_common3_context(shared_experts=torch.nn.Identity())
        fused_moe = importlib.import_module(FUSED_MOE)
        monkeypatch.setattr(
            fused_moe.AscendFusedMoE, "gate_stream", SimpleNamespace(wait_stream=lambda stream: None), raising=False
        )
