# SPDX-License-Identifier: Apache-2.0
"""vllm-ascend's real MoE layer, run on the CPU, in each of its three designs (``design()``):

* ``layer`` (0.20.2rc1-0.23.x): ``AscendFusedMoE.forward_impl`` through its ``AscendMoERunner``, the quant
  method's ``apply`` calling ``select_experts``;
* ``runner`` (0.24.0rc1-0.26.0rc1): vLLM's ``FusedMoE`` factory returns vllm-ascend's ``AscendMoERunner``, which
  is the layer: its ``_forward_impl`` calls the quant method of its ``routed_experts`` (vLLM's
  ``RoutedExperts``), whose ``apply`` calls ``select_experts``;
* ``router`` (0.27.1rc1 on): ``AscendMoERunner._forward_impl`` calls ``AscendRoutedExperts.forward_impl``,
  which routes through its router (a real vllm-ascend router subclassing vLLM's ``BaseRouter``), applies
  ``log2phy``, then hands the physical ids to the quant method's ``apply``.

The quant method's ``apply`` runs to its end, ``select_experts`` / the router on their native torch path, the
real flash-comm3 (gate) context. Only the device communication is a stand-in (``StubCommMethod``: prepare /
fused_experts / finalize, which on an NPU dispatch tokens to experts); it applies the EPLB ``log2phy`` map the
way vllm-ascend's dispatcher does, so the ids the experts compute on (physical) differ from the ids recorded
(logical). The forward context is a plain namespace holding the attributes vllm-ascend reads from it.

Objects are built without their NPU-only ``__init__`` (routers excepted: theirs is plain Python): attributes
``__init__`` would set are set here, every other attribute reads as ``None`` (feature flags off).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

FUSED_MOE = "vllm_ascend.ops.fused_moe.fused_moe"
SELECTOR = "vllm_ascend.ops.fused_moe.experts_selector"
ROUTED_EXPERTS = "vllm_ascend.ops.fused_moe.routed_experts"
ROUTERS = "vllm_ascend.ops.fused_moe.router"
FORWARD_CONTEXT = "vllm_ascend.ascend_forward_context"
FLASH_COMMON3 = "vllm_ascend.flash_common3_context"
DESIGNS = ("layer", "runner", "router")


def design() -> str:
    """Which of vllm-ascend's MoE designs this release has (see the module docstring)."""
    if importlib.util.find_spec(ROUTED_EXPERTS) is not None:
        return "router"
    return "layer" if hasattr(importlib.import_module(FUSED_MOE), "AscendFusedMoE") else "runner"


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
    ``prepare`` and ``finalize`` pass tokens through; ``fused_experts`` keeps what ``apply`` handed it and the
    physical ids the experts compute on: the dispatcher maps logical ids with EPLB's ``log2phy`` where
    ``apply`` hands it the map (select_experts designs), the router design hands it physical ids."""

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
        log2phy = _find(given, "log2phy", missing=None)
        physical = topk_ids.long() if log2phy is None else log2phy[topk_ids.long()].long()
        self.dispatched.append({"topk_ids": topk_ids.clone(), "log2phy": log2phy, "physical": physical})
        return self.result(_find(given, "hidden_states"))

    @staticmethod
    def result(hidden_states: torch.Tensor) -> Any:
        """What vllm-ascend's fused_experts returns, with the input as the experts' output."""
        module = importlib.import_module(FUSED_MOE if design() != "router" else "vllm_ascend.ops.fused_moe")
        result_cls = getattr(module, "FusedExpertsResult", None)
        if result_cls is None:
            comm_method = importlib.import_module(f"{module.__name__}.moe_comm_method")
            result_cls = getattr(comm_method, "FusedExpertsResult", None)
        return hidden_states.clone() if result_cls is None else result_cls(routed_out=hidden_states.clone())

    def finalize(self, hidden_states: torch.Tensor, **_: Any) -> torch.Tensor:
        return hidden_states


_MISSING = object()


def _find(container: Any, name: str, missing: Any = _MISSING) -> Any:
    """An attribute of vllm-ascend's fused-experts input, wherever its release nests it."""
    if hasattr(container, name):
        return getattr(container, name)
    for part in dataclasses.fields(container) if dataclasses.is_dataclass(container) else ():
        value = getattr(container, part.name)
        if hasattr(value, name):
            return getattr(value, name)
    if missing is not _MISSING:
        return missing
    raise AssertionError(f"fused_experts input has no {name}: {container!r}")


NUM_EXPERTS, TOP_K, HIDDEN = 8, 2, 16


class _Projection(torch.nn.Module):
    """A vLLM linear layer's call convention (``(output, bias)``), on a fixed weight."""

    def __init__(self, rows: int, cols: int, seed: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)))
        self.input_size = cols

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None


class SharedMLP(torch.nn.Module):
    """A shared expert the way vLLM's models build it (DeepSeek, Qwen2-MoE, GLM): gate-up projection,
    SiLU-and-multiply, down projection; the real one runs in vllm-ascend's shared-expert path."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = _Projection(2 * HIDDEN, HIDDEN, 1)
        self.down_proj = _Projection(HIDDEN, HIDDEN, 2)
        self.expert_gate = None

    def act_fn(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))[0]

    def expected(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


@dataclass
class RealMoE:
    """One real vllm-ascend MoE layer with a real quant method, and the stand-ins around it.

    ``layer`` is what the model holds (and the plugin binds); ``experts`` holds the quant method, weights and
    EPLB state (the layer itself, vLLM's ``RoutedExperts`` or ``AscendRoutedExperts``)."""

    layer: torch.nn.Module
    experts: Any
    runner: Any
    comm: StubCommMethod
    layer_id: int
    forward_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], Any]

    def forward(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> Any:
        """What vLLM's ``moe_forward`` op runs for this design (``input_ids``: the router design's argument;
        the select_experts designs read them from the forward context)."""
        return self.forward_fn(hidden_states, router_logits, input_ids)

    @property
    def log2phy(self) -> torch.Tensor:
        return self.experts.log2phy  # type: ignore[no-any-return]

    def set_log2phy(self, log2phy: torch.Tensor) -> None:
        """Where each design keeps the map it applies (the runner design's runner passes its own)."""
        self.experts.log2phy = log2phy
        self.layer.log2phy = log2phy

    @property
    def router(self) -> Any:
        return self.experts.router


def _set(target: Any, attributes: dict[str, Any], *, raw: bool = False) -> None:
    """Set what ``__init__`` would have; ``raw`` bypasses ``nn.Module.__setattr__`` (vLLM's MoE methods are
    CustomOps whose submodule bookkeeping is not wanted here)."""
    for name, value in attributes.items():
        if isinstance(getattr(type(target), name, None), property):  # e.g. layer_id: derived from layer_name
            continue
        if raw:
            object.__setattr__(target, name, value)
        else:
            setattr(target, name, value)


def _layer_attributes(method: Any, layer_id: int, gate: bool, log2phy: torch.Tensor) -> dict[str, Any]:
    return {
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
        "moe_config": SimpleNamespace(
            num_experts=NUM_EXPERTS,
            num_logical_experts=NUM_EXPERTS,
            has_bias=False,
            is_sequence_parallel=False,
            sp_size=1,
            experts_per_token=TOP_K,
        ),
        "tid2eid": None,
        "activation": "silu",
        "apply_router_weight_on_input": False,
        "_expert_map": None,
        "ascend_expert_map": None,
        # EPLB's logical -> physical map: a permutation that moves ids, so physical ids differ from logical.
        "log2phy": log2phy,
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
        "mix_placement": False,
        "return_with_event": False,
        "_use_v2_model_runner": False,
        # routed experts on: vllm-ascend's own capture branch runs (and finds no capturer: the plugin's binder
        # replaced the one that would set it)
        "vllm_config": SimpleNamespace(model_config=SimpleNamespace(enable_return_routed_experts=True)),
    }


def _method_attributes(method: Any, gate: bool) -> None:
    method_attributes = {
        "moe": SimpleNamespace(has_bias=False),
        "multistream_overlap_gate": gate,
        "dynamic_eplb": False,
        "in_dtype": torch.float32,
        "tid2eid": None,
    }
    wrapped = method
    while wrapped is not None:  # the adapter, the scheme it delegates to, and the method that serves it
        _set(wrapped, method_attributes, raw=True)
        wrapped = vars(wrapped).get("quant_method") or vars(wrapped).get("_bf16_method")


def unquantized_method() -> type:
    """vllm-ascend's unquantized MoE method class (in ``fused_moe`` before the router design)."""
    module = importlib.import_module(ROUTED_EXPERTS if design() == "router" else FUSED_MOE)
    return module.AscendUnquantizedFusedMoEMethod  # type: ignore[no-any-return]


def native_router(top_k: int = TOP_K, num_experts: int = NUM_EXPERTS) -> Any:
    """vllm-ascend's native-path router (router design): softmax + top-k in torch, its real ``__init__``."""
    routers = importlib.import_module(f"{ROUTERS}.grouped_topk_router")
    return routers.AscendGroupedTopKRouter(
        top_k=top_k, global_num_experts=num_experts, num_expert_group=None, topk_group=None
    )


def router_310p(top_k: int = TOP_K, num_experts: int = NUM_EXPERTS) -> Any:
    """vllm-ascend's 310P router (router design): its NPU gating kernel (stubbed) in chunks of 1024 tokens."""
    routers = importlib.import_module("vllm_ascend._310p.fused_moe.grouped_topk_router")
    return routers.AscendGroupedTopKRouter310(
        top_k=top_k, global_num_experts=num_experts, num_expert_group=None, topk_group=None
    )


def build(
    monkeypatch: pytest.MonkeyPatch,
    method: Any,
    *,
    layer_id: int = 2,
    gate: bool = False,
    layer_cls: type | None = None,
    profile_run: bool = False,
    router: Any = None,
    comm_type: str = "ALLGATHER",
    shared: SharedMLP | None = None,
) -> RealMoE:
    """A real vllm-ascend MoE layer of this release's design around ``method`` (``multistream_overlap_gate``
    = ``gate`` where the design has it; ``router``: the router design's router, default the native one)."""
    generator = torch.Generator().manual_seed(layer_id)
    log2phy = torch.randperm(NUM_EXPERTS, generator=generator).to(torch.int32)
    attributes = _layer_attributes(method, layer_id, gate, log2phy)
    _method_attributes(method, gate)
    comm = StubCommMethod()
    fused_moe = importlib.import_module(FUSED_MOE)
    kind = design()
    if kind == "layer":
        layer = probe_instance(layer_cls or fused_moe.AscendFusedMoE, weights=True)
        _set(layer, attributes)
        runner = object.__new__(fused_moe.AscendMoERunner)
        object.__setattr__(runner, "_shared_experts", shared)  # read through MoERunner.shared_experts
        object.__setattr__(layer, "runner", runner)
        _set(layer, _shared_attributes(shared))
        experts = layer

        def forward_fn(hidden: torch.Tensor, logits: torch.Tensor, input_ids: torch.Tensor | None) -> Any:
            return runner.forward_impl(layer, hidden, logits, None)

    elif kind == "runner":
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        layer = probe_instance(layer_cls or fused_moe.AscendMoERunner, weights=True)
        experts = probe_instance(RoutedExperts, weights=True)
        _set(experts, attributes)
        _set(layer, {**attributes, "quant_method": None, "gate": None, **_shared_attributes(shared)})
        layer.routed_experts = experts
        runner = layer

        def forward_fn(hidden: torch.Tensor, logits: torch.Tensor, input_ids: torch.Tensor | None) -> Any:
            return layer._forward_impl(hidden, logits, None)

    else:
        routed = importlib.import_module(ROUTED_EXPERTS)
        experts = probe_instance(layer_cls or routed.AscendRoutedExperts, weights=True)
        _set(experts, attributes)
        layer = probe_instance(fused_moe.AscendMoERunner, weights=True)
        _set(layer, {"layer_name": attributes["layer_name"], "moe_config": attributes["moe_config"]})
        _set(layer, {"gate": None, "_gate": None, **_shared_attributes(shared)})
        _set(layer, {"ascend_shared_experts": _ascend_shared_experts(monkeypatch, shared, attributes["moe_config"])})
        _set(experts, {"return_with_event": shared is not None})
        layer.routed_experts = experts
        if router is None:  # the 310P layer routes with the 310P router (chunked NPU gating kernel)
            router = router_310p() if layer_cls is not None and "310" in layer_cls.__name__ else native_router()
        chosen = router
        object.__setattr__(layer, "router", chosen)
        object.__setattr__(experts, "router", chosen)
        ascend_config = SimpleNamespace(enable_force_eplb=False)
        monkeypatch.setattr(routed, "get_ascend_config", lambda: ascend_config, raising=False)
        if hasattr(routed, "get_moe_comm_method"):  # 0.28+: the comm method is looked up per forward
            monkeypatch.setattr(routed, "get_moe_comm_method", lambda *a, **k: comm)
        runner = layer

        def forward_fn(hidden: torch.Tensor, logits: torch.Tensor, input_ids: torch.Tensor | None) -> Any:
            return layer._forward_impl(hidden, logits, None, input_ids)

    _forward_context(monkeypatch, comm, gate, profile_run, comm_type)
    return RealMoE(layer, experts, runner, comm, layer_id, forward_fn)


def _shared_attributes(shared: SharedMLP | None) -> dict[str, Any]:
    """What a layer with (or without) shared experts holds, their multistream overlap off."""
    from vllm_ascend.quantization.quant_type import QuantType

    return {
        "_shared_experts": shared,
        "multistream_overlap_shared_expert": False,
        "shared_multistream_overlap_gate": False,
        "quant_type": QuantType.NONE,
    }


def _ascend_shared_experts(monkeypatch: pytest.MonkeyPatch, shared: SharedMLP | None, moe_config: Any) -> Any:
    """The router design's shared-expert executor, built by its real ``__init__`` (overlap off)."""
    if shared is None:
        return None
    module = importlib.import_module("vllm_ascend.ops.fused_moe.shared_experts")
    config = SimpleNamespace(multistream_overlap_shared_expert=False, enable_shared_expert_dp=False)
    monkeypatch.setattr(module, "get_ascend_config", lambda: config)
    from vllm_ascend.quantization.quant_type import QuantType

    for name, value in {"hidden_dim": HIDDEN, "in_dtype": torch.float32, "swiglu_limit": None}.items():
        setattr(moe_config, name, value)
    moe_config.swiglu_alpha, moe_config.swiglu_beta = None, None
    moe_config.tp_group = SimpleNamespace(world_size=1)  # TP 1: the shared expert runs tensor-parallel
    return module.AscendSharedExperts(shared, moe_config, QuantType.NONE, None)


def _forward_context(
    monkeypatch: pytest.MonkeyPatch, comm: StubCommMethod, gate: bool, profile_run: bool, comm_type: str
) -> None:
    forward_context = importlib.import_module(FORWARD_CONTEXT)
    context = SimpleNamespace(
        moe_comm_method=comm,
        moe_comm_type=getattr(forward_context.MoECommType, comm_type),
        in_profile_run=profile_run,
        flash_comm_v1_enabled=False,
        input_ids=None,
        all_moe_layers=None,
        moe_layer_index=0,
        eplb_heat_collection_status=False,
        dp_metadata=None,
        use_mega_moe=False,
        use_megamoe=False,
    )
    # vLLM's own forward context, which vllm-ascend's _EXTRA_CTX proxy and get_forward_context read.
    monkeypatch.setattr(importlib.import_module("vllm.forward_context"), "_forward_context", context)
    if design() != "router":
        selector = importlib.import_module(SELECTOR)
        monkeypatch.setattr(selector, "check_npu_moe_gating_top_k", lambda *a, **k: False)  # native torch path
        if hasattr(selector, "get_weight_prefetch_method"):
            monkeypatch.setattr(selector, "get_weight_prefetch_method", lambda: None)
    flash_common3 = importlib.util.find_spec(FLASH_COMMON3)
    if flash_common3 is None:
        return
    flash = importlib.import_module(FLASH_COMMON3)
    monkeypatch.setattr(flash, "_flash_common3_context", None)
    if gate:  # what vllm-ascend's model sets before the MoE runs: the shared experts the gate stream runs
        flash.set_flash_common3_context(shared_experts=torch.nn.Identity())
        fused_moe = importlib.import_module(FUSED_MOE)
        monkeypatch.setattr(
            fused_moe.AscendFusedMoE, "gate_stream", SimpleNamespace(wait_stream=lambda stream: None), raising=False
        )
