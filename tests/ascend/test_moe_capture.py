# SPDX-License-Identifier: Apache-2.0
"""Every vllm-ascend MoE quant method, run through the real MoE forward of this release's design
(``real_moe``: the layer's ``forward_impl``, the runner's ``_forward_impl``, or the runner driving
``AscendRoutedExperts`` and its real router), records exactly the router's top-k: the expected ids come from
an independent top-k of the router logits, and ``apply`` runs to its end (only the device communication is
stubbed, see ``real_moe``), so EPLB's ``log2phy`` (applied by the stub dispatcher, or by the router design's
``_select_experts``), forced load balancing and ``mix_placement`` really execute after the ids were recorded:
the ids the experts compute on differ from the recorded ones while the recorded ones equal the reference."""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.ascend import moe_methods, real_moe
from tests.ascend.conftest import ASCEND_RELEASE, ASCEND_SRC, EXPECTED
from vllm_ascend_routing import envs
from vllm_ascend_routing.backends import BACKENDS, ascend, ascend_router
from vllm_ascend_routing.backends._recorded import RoutingNotRecordedError
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

NUM_TOKENS, NUM_LAYERS = 6, 4
METHODS = moe_methods.method_classes() if ASCEND_SRC else ()
DESIGN = real_moe.design() if ASCEND_SRC else ""
# The multistream gate path (the layer calls select_experts itself) exists in the layer design only.
GATES = [False, True] if DESIGN == "layer" else [False]


def bound(moe: real_moe.RealMoE, num_tokens: int = NUM_TOKENS) -> torch.Tensor:
    """Bind ``moe`` through the plugin's own backend choice (``BACKENDS``, first that handles it)."""
    buffer = new_capture_buffer(num_tokens, NUM_LAYERS, real_moe.TOP_K, real_moe.NUM_EXPERTS, "cpu")
    capture = LayerCapture(buffer, moe.layer_id, real_moe.NUM_EXPERTS, new_error_counter("cpu"))
    name, backend = next((name, backend) for name, backend in BACKENDS if backend.handles(moe.layer))
    assert name == ("ascend_router" if DESIGN == "router" else "ascend")
    backend.bind(moe.layer, capture, moe.layer.layer_name)
    return buffer


def inputs(seed: int, num_tokens: int = NUM_TOKENS, experts: int = real_moe.NUM_EXPERTS) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, real_moe.HIDDEN, generator=generator)
    return hidden, torch.randn(num_tokens, experts, generator=generator)


def build(monkeypatch: pytest.MonkeyPatch, cls: type, **kwargs: Any) -> real_moe.RealMoE:
    return real_moe.build(
        monkeypatch, moe_methods.method_instance(cls), layer_cls=moe_methods.layer_class(cls), **kwargs
    )


def test_the_release_has_the_design_the_suite_expects() -> None:
    """A vllm-ascend release whose MoE moved to another design fails here (the release table names each)."""
    assert EXPECTED is not None, f"vllm-ascend {ASCEND_RELEASE} is not in releases.py ASCEND_RELEASES"
    assert EXPECTED.design.value == DESIGN


def test_every_method_is_found_and_none_hides() -> None:
    assert moe_methods.unimportable_method_modules() == {}
    names = {cls.__name__ for cls in METHODS}
    assert "AscendUnquantizedFusedMoEMethod" in names
    assert any("W8A8" in name for name in names), names
    assert any(moe_methods.is_310p(cls) for cls in METHODS), names
    # Inherited apply methods count too (PDMix and FP8-dynamic inherit W8A8-dynamic's apply).
    assert any("apply" not in vars(cls) for cls in METHODS), names


def test_the_kernel_path_in_use() -> None:
    """make test-ascend runs the suite with ``VLLM_ASCEND_ROUTING_FORCE_REFERENCE=1`` (the PyTorch reference the
    NPU runs unless the AscendC kernel is built); run by hand without it, the CPU's direct write / host kernel
    serve instead: this says which one this process exercises."""
    from vllm_ascend_routing.ops import _library, eager_view

    buffer = new_capture_buffer(2, 1, 2, 8, "cpu")
    assert _library.HOST_KERNEL is not envs.VLLM_ASCEND_ROUTING_FORCE_REFERENCE
    assert (eager_view(buffer, 0) is None) is envs.VLLM_ASCEND_ROUTING_FORCE_REFERENCE


@pytest.mark.parametrize("gate", GATES, ids=lambda gate: "gate-on" if gate else "gate-off")
@pytest.mark.parametrize("cls", METHODS, ids=moe_methods.method_id)
def test_real_forward_records_the_router_top_k(monkeypatch: pytest.MonkeyPatch, cls: type, gate: bool) -> None:
    moe = build(monkeypatch, cls, gate=gate)
    buffer = bound(moe)
    hidden, logits = inputs(seed=len(cls.__name__) + gate)
    moe.forward(hidden, logits)
    expected = real_moe.reference_top_k(logits, real_moe.TOP_K)
    recorded = buffer[:, moe.layer_id].long()
    (dispatched,) = moe.comm.dispatched
    if moe_methods.is_310p(cls):  # the 310P gating kernel (stubbed) returns the top-k in its own order
        assert torch.equal(recorded.sort().values, expected.sort().values)
    else:
        assert torch.equal(recorded, expected)
    others = [layer_id for layer_id in range(NUM_LAYERS) if layer_id != moe.layer_id]
    assert (buffer[:, others] == 0).all()  # the layer id comes from the layer
    # The experts computed on physical ids (log2phy applied by the dispatcher or the router design), which
    # differ from the recorded logical ones: recording physical ids would have failed the equality above.
    if moe_methods.is_310p(cls) and DESIGN != "router":  # 310P's select_experts designs have no EPLB
        assert torch.equal(dispatched["physical"], recorded)
    else:
        assert torch.equal(dispatched["physical"], moe.log2phy[recorded].long())
        assert not torch.equal(dispatched["physical"], recorded)


COMMON_METHODS = [
    c for c in METHODS if c.__name__ in {"AscendUnquantizedFusedMoEMethod", "AscendW8A8DynamicFusedMoEMethod"}
]


# vllm-ascend's own failures on a path, with or without the plugin (release, method, comm type): the error it
# raises after routing. Checked, so a release that fixes (or changes) one fails here until this is updated.
UPSTREAM_FAILURES = {
    # its unquantized FUSED_MC2 branch reads _EXTRA_CTX.use_megamoe, which its forward-context proxy rejects
    ("0.26.0rc1", "AscendUnquantizedFusedMoEMethod", "FUSED_MC2"): "use_megamoe is not extra forward context",
}


@pytest.mark.parametrize("comm_type", ["ALLGATHER", "MC2", "ALLTOALL", "FUSED_MC2"])
@pytest.mark.parametrize("cls", COMMON_METHODS, ids=moe_methods.method_id)
def test_every_comm_method_records_the_router_top_k(monkeypatch: pytest.MonkeyPatch, cls: type, comm_type: str) -> None:
    """The comm type in the forward context picks ``apply``'s branch (FUSED_MC2: the fused dispatch / FFN /
    combine kernel's weight lists and scales); routing comes first in every one of them."""
    moe = build(monkeypatch, cls, comm_type=comm_type)
    buffer = bound(moe)
    hidden, logits = inputs(seed=31)
    expected = real_moe.reference_top_k(logits, real_moe.TOP_K)
    upstream = UPSTREAM_FAILURES.get((ASCEND_RELEASE, cls.__name__, comm_type))
    if upstream is not None:  # vllm-ascend fails after routing; the rows were recorded before it did
        with pytest.raises(AttributeError, match=upstream):
            moe.forward(hidden, logits)
        assert torch.equal(buffer[:, moe.layer_id].long(), expected)
        return
    moe.forward(hidden, logits)
    assert torch.equal(buffer[:, moe.layer_id].long(), expected)
    (dispatched,) = moe.comm.dispatched
    assert torch.equal(dispatched["physical"], moe.log2phy[expected].long())


@pytest.mark.parametrize("cls", COMMON_METHODS, ids=moe_methods.method_id)
def test_a_layer_with_shared_experts_records_the_routed_ids(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    """DeepSeek / Qwen2-MoE / GLM layers: the shared-expert forward path (``shared_forward_impl``, or the
    router design's ``AscendSharedExperts``) runs the routed experts through the same guarded forward; the
    shared expert's output is the real MLP's, and only the routed ids are recorded."""
    shared = real_moe.SharedMLP()
    moe = build(monkeypatch, cls, shared=shared)
    buffer = bound(moe)
    hidden, logits = inputs(seed=37)
    output = moe.forward(hidden, logits)
    shared_out, routed_out = output
    assert torch.allclose(shared_out, shared.expected(hidden))
    assert torch.equal(buffer[:, moe.layer_id].long(), real_moe.reference_top_k(logits, real_moe.TOP_K))


@pytest.mark.parametrize("cls", COMMON_METHODS, ids=moe_methods.method_id)
def test_forced_load_balancing_is_not_recorded(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    """Profile runs replace the routed ids by random ones after routing: the rows keep the router's."""
    moe = build(monkeypatch, cls, profile_run=True)
    buffer = bound(moe)
    hidden, logits = inputs(seed=5)
    torch.manual_seed(0)
    moe.forward(hidden, logits)
    expected = real_moe.reference_top_k(logits, real_moe.TOP_K)
    assert torch.equal(buffer[:, moe.layer_id].long(), expected)
    (dispatched,) = moe.comm.dispatched
    assert not torch.equal(dispatched["topk_ids"].long(), expected)  # balancing really ran
    assert not torch.equal(dispatched["topk_ids"].long(), moe.log2phy[expected].long())


def test_mix_placement_keeps_the_routed_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """With mix_placement, routing appends the shared expert's id after the routed ones (in select_experts,
    for the methods that pass it, or in the router design's ``_select_experts``). Every release has it: a
    release where the suite no longer finds it fails here rather than skipping."""
    if DESIGN == "router":
        cls = next(c for c in METHODS if c.__name__ == "AscendUnquantizedFusedMoEMethod")
        assert "mix_placement" in inspect.getsource(importlib.import_module(real_moe.ROUTED_EXPERTS))
    else:
        candidates = [cls for cls in METHODS if "mix_placement" in inspect.getsource(cls.apply)]  # type: ignore[attr-defined]
        assert candidates, f"no MoE method of vllm-ascend {ASCEND_RELEASE} passes mix_placement any more"
        cls = candidates[0]
    moe = build(monkeypatch, cls)
    moe.experts.mix_placement, moe.experts.n_shared_experts = True, 1
    moe.experts.moe_config.num_experts += 1  # the shared expert is placed among the routed ones
    moe.set_log2phy(torch.cat([moe.log2phy, torch.tensor([real_moe.NUM_EXPERTS], dtype=torch.int32)]))
    buffer = bound(moe)
    hidden, logits = inputs(seed=7)
    moe.forward(hidden, logits)
    (dispatched,) = moe.comm.dispatched
    assert dispatched["topk_ids"].shape == (NUM_TOKENS, real_moe.TOP_K + 1)  # the shared expert's column
    assert torch.equal(buffer[:, moe.layer_id].long(), real_moe.reference_top_k(logits, real_moe.TOP_K))


# 310P releases whose routing still runs vllm-ascend's native torch top-k (no NPU gating kernel, no chunks).
NATIVE_310P_RELEASES = ("0.20.2rc1",)


def test_the_310p_chunked_gating_over_1024_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """310P routes with its NPU gating kernel (stubbed: its own order within a token's top-k) in chunks of
    1024 tokens; a 1500-token step records every token, the rows as the kernel returned them."""
    cls = next(c for c in METHODS if moe_methods.is_310p(c) and "Unquantized" in c.__name__)
    tokens = 1500
    moe = build(monkeypatch, cls)
    buffer = bound(moe, num_tokens=tokens)
    hidden, logits = inputs(seed=15, num_tokens=tokens)
    moe.forward(hidden, logits)
    recorded = buffer[:, moe.layer_id].long()
    expected = real_moe.reference_top_k(logits, real_moe.TOP_K)
    if ASCEND_RELEASE in NATIVE_310P_RELEASES:  # no kernel in this release: the native top-k, in its order
        assert torch.equal(recorded, expected)
        return
    assert torch.equal(recorded.sort().values, expected.sort().values)
    assert not torch.equal(recorded, expected)  # the kernel's order, not the reference's: compared as sets
    (dispatched,) = moe.comm.dispatched
    logical = dispatched["topk_ids"].long() if DESIGN != "router" else _logical(moe, dispatched["topk_ids"])
    assert torch.equal(logical, recorded)  # exactly what the experts computed on, before EPLB


def _logical(moe: real_moe.RealMoE, physical: torch.Tensor) -> torch.Tensor:
    return torch.argsort(moe.log2phy.long())[physical.long()]


def fused_gating_ids(num_tokens: int, top_k: int = real_moe.TOP_K) -> torch.Tensor:
    """What the stubbed NPU gating kernel returns: a fixed permutation per token, unrelated to the logits."""
    token = torch.arange(num_tokens).unsqueeze(1)
    return ((token * 3 + torch.arange(top_k) * 5) % real_moe.NUM_EXPERTS).to(torch.int32)


def _stub_gating_kernel(monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
    def moe_gating_top_k(router_logits: torch.Tensor, k: int, **_: Any) -> tuple[torch.Tensor, ...]:
        ids = fused_gating_ids(router_logits.shape[0], k)
        return torch.full(ids.shape, 1.0 / k), ids, None

    monkeypatch.setattr(module, "DeviceOperator", SimpleNamespace(moe_gating_top_k=moe_gating_top_k))


def test_the_fused_gating_kernel_path_records_what_the_kernel_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NPU's fused gating kernel (vllm-ascend's default route for softmax / sigmoid routers), stubbed to
    return a known permutation: the rows are the kernel's choice, not a recomputation."""
    cls = next(c for c in METHODS if c.__name__ == "AscendUnquantizedFusedMoEMethod")
    if DESIGN == "router":
        fused = importlib.import_module(f"{real_moe.ROUTERS}.fused_topk_router")
        router = fused.AscendFusedTopKRouter(top_k=real_moe.TOP_K, global_num_experts=real_moe.NUM_EXPERTS)
        _stub_gating_kernel(monkeypatch, fused)
        moe = build(monkeypatch, cls, router=router)
    else:
        moe = build(monkeypatch, cls)
        selector = importlib.import_module(real_moe.SELECTOR)
        monkeypatch.setattr(selector, "check_npu_moe_gating_top_k", lambda *a, **k: True)
        _stub_gating_kernel(monkeypatch, selector)
    buffer = bound(moe)
    moe.forward(*inputs(seed=17))
    assert torch.equal(buffer[:, moe.layer_id].long(), fused_gating_ids(NUM_TOKENS).long())


def test_the_hash_routing_path_records_the_table_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V4's hash routing (``sqrtsoftplus`` scoring with a token-to-expert table ``tid2eid``): the NPU's
    fused ``moe_gating_top_k_hash`` kernel, stubbed to return the table's row for each token id, after
    vllm-ascend gathered the step's input ids; the rows are the table lookup, exactly."""
    cls = next(c for c in METHODS if c.__name__ == "AscendUnquantizedFusedMoEMethod")
    table = torch.stack(
        [torch.randperm(real_moe.NUM_EXPERTS, generator=torch.Generator().manual_seed(v))[:2] for v in range(32)]
    )
    input_ids = torch.tensor([3, 17, 0, 31, 5, 17])
    calls: list[torch.Tensor] = []

    def moe_gating_top_k_hash(x: torch.Tensor, k: int, input_ids: torch.Tensor, tid2eid: torch.Tensor, **_: Any) -> Any:
        calls.append(input_ids)
        ids = tid2eid[input_ids.long()][:, :k].to(torch.int32)
        return torch.full(ids.shape, 1.0 / k), ids, None

    monkeypatch.setattr(
        torch.ops, "_C_ascend", SimpleNamespace(moe_gating_top_k_hash=moe_gating_top_k_hash), raising=False
    )
    identity = SimpleNamespace(all_gather_input_ids=lambda ids: ids, all_gather_input_id_with_dp_group=lambda ids: ids)
    if DESIGN == "router":
        fused = importlib.import_module(f"{real_moe.ROUTERS}.fused_topk_router")
        router = fused.AscendFusedTopKRouter(
            top_k=real_moe.TOP_K, global_num_experts=real_moe.NUM_EXPERTS, scoring_func="sqrtsoftplus", tid2eid=table
        )
        moe = build(monkeypatch, cls, router=router)
    else:
        moe = build(monkeypatch, cls)
        moe.experts.quant_method.tid2eid = table
        for part in {id(moe.layer): moe.layer, id(moe.runner): moe.runner}.values():
            part.scoring_func = "sqrtsoftplus"
        selector = importlib.import_module(real_moe.SELECTOR)
        monkeypatch.setattr(selector, "check_npu_moe_gating_top_k", lambda *a, **k: True)
    moe.comm.prepare_finalize = identity
    importlib.import_module("vllm.forward_context")._forward_context.input_ids = input_ids
    buffer = bound(moe)
    moe.forward(*inputs(seed=41), input_ids=input_ids)
    assert calls, "the hash kernel was not reached"
    assert torch.equal(buffer[:, moe.layer_id].long(), table[input_ids][:, : real_moe.TOP_K])


def test_a_forward_that_does_not_reach_the_seam_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A path that routes without the seam (a fused gating kernel in ``apply``; a routed-experts class that
    computes routing without its router's template) raises instead of leaving zeros."""
    cls = next(c for c in METHODS if c.__name__ == "AscendUnquantizedFusedMoEMethod")
    moe = build(monkeypatch, cls)
    buffer = bound(moe)
    if DESIGN == "router":
        router = moe.router

        def select_bypassing_the_template(hidden_states: torch.Tensor, router_logits: torch.Tensor, **_: Any) -> Any:
            return router._compute_routing(hidden_states, router_logits, None)

        moe.experts._select_experts = select_bypassing_the_template
        match = "without reaching"
    else:
        moe.experts.quant_method.apply = lambda **kwargs: moe.comm.result(kwargs["x"])
        match = "without calling select_experts"
    with pytest.raises(RoutingNotRecordedError, match=match):
        moe.forward(*inputs(seed=1))
    assert (buffer == 0).all()


def test_a_layer_that_routes_another_way_is_refused_at_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from the bytecode at bind time: a quant method whose ``apply`` never calls select_experts, or a
    router whose ``_select_experts`` never calls its capture hook, is refused before the first forward."""
    fused_moe = importlib.import_module(real_moe.FUSED_MOE if DESIGN != "router" else real_moe.ROUTED_EXPERTS)
    if DESIGN == "router":
        base = type(real_moe.native_router())

        class OwnTemplateRouter(base):  # type: ignore[misc,valid-type]
            def _select_experts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, **_: Any) -> Any:
                return self._compute_routing(hidden_states, router_logits, None)

        router = OwnTemplateRouter(
            top_k=real_moe.TOP_K, global_num_experts=real_moe.NUM_EXPERTS, num_expert_group=None, topk_group=None
        )
        moe = real_moe.build(
            monkeypatch, real_moe.probe_instance(fused_moe.AscendUnquantizedFusedMoEMethod), router=router
        )
        with pytest.raises(RoutingNotRecordedError, match="OwnTemplateRouter's _select_experts never calls"):
            bound(moe)
        return

    class GatingKernelMethod(fused_moe.AscendUnquantizedFusedMoEMethod):  # type: ignore[misc,name-defined]
        def apply(self, **kwargs: Any) -> Any:  # routes in a fused kernel, never calls select_experts
            return kwargs["x"]

    moe = real_moe.build(monkeypatch, real_moe.probe_instance(GatingKernelMethod))
    with pytest.raises(RoutingNotRecordedError, match="GatingKernelMethod routes without"):
        bound(moe)


@pytest.mark.parametrize("device", ["npu-path", "cpu-path"])
def test_recording_adds_one_op_and_no_sync(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Counting, not timing: besides vllm-ascend's own ops, the bound forward dispatches exactly one
    ``record_topk_ids`` and nothing that synchronises with the host. On an NPU the ids are device tensors,
    so ``ops.LayerRecorder`` never takes its eager CPU write (simulated here: no eager view at bind); with the
    stubbed CPU tensors of this suite it does, and adds exactly the direct write's ops."""
    from tests.test_hot_path import EAGER_CAPTURE_OPS, OpLog
    from vllm_ascend_routing.ops import _recorder

    cls = next(c for c in METHODS if c.__name__ == "AscendUnquantizedFusedMoEMethod")
    hidden, logits = inputs(seed=11)

    def forward_ops(bind: bool) -> list[str]:
        with monkeypatch.context() as patch:
            moe = real_moe.build(patch, real_moe.probe_instance(cls))
            if bind:
                if device == "npu-path":
                    patch.setattr(_recorder, "eager_view", lambda out, layer_id: None)
                bound(moe)
            with OpLog() as log:
                moe.forward(hidden, logits)
        return log.ops

    unbound, with_capture = forward_ops(bind=False), forward_ops(bind=True)
    added = list(with_capture)
    for op in unbound:
        added.remove(op)
    if device == "npu-path" or envs.VLLM_ASCEND_ROUTING_FORCE_REFERENCE:
        assert added == ["vllm_ascend_routing::record_topk_ids"]
        assert syncing(with_capture) == syncing(unbound)
    else:  # the bounds' host reads are of CPU memory: nothing is waited for
        assert added == EAGER_CAPTURE_OPS


def syncing(ops: list[str]) -> list[str]:
    from tests.test_hot_path import SYNCING

    return [op for op in ops if op.split("::")[-1].split(".")[0] in SYNCING]


@pytest.mark.parametrize(
    "draft_layer_name",
    ["model.layers.2.mlp.experts", "model.layers.4.mlp.experts"],
    ids=["draft-aliases-target-id", "mtp-id-past-the-target"],
)
def test_a_draft_or_mtp_layer_neither_writes_nor_trips_the_guard(
    monkeypatch: pytest.MonkeyPatch, draft_layer_name: str
) -> None:
    """A draft model's (or MTP module's) MoE layer is never bound: its real forward records nothing, even
    when its layer id aliases a bound target layer (a draft model's layers start at 0; Qwen3-Next MTP is
    mtp.layers.0), and raises nothing (DeepSeek/GLM MTP ids start at num_hidden_layers)."""
    cls = next(c for c in METHODS if c.__name__ == "AscendUnquantizedFusedMoEMethod")
    target = real_moe.build(monkeypatch, real_moe.probe_instance(cls))
    buffer = bound(target)
    hidden, logits = inputs(seed=21)
    target.forward(hidden, logits)
    recorded = buffer.clone()
    draft = real_moe.build(monkeypatch, real_moe.probe_instance(cls))
    draft.layer.layer_name = draft_layer_name
    draft_hidden, draft_logits = inputs(seed=22)
    draft.forward(draft_hidden, draft_logits)  # the drafter runs after the target in the same step
    (dispatched,) = draft.comm.dispatched
    assert torch.equal(
        dispatched["physical"], draft.log2phy[real_moe.reference_top_k(draft_logits, real_moe.TOP_K)].long()
    )
    assert torch.equal(buffer, recorded)
    assert torch.equal(buffer[:, target.layer_id].long(), real_moe.reference_top_k(logits, real_moe.TOP_K))


@pytest.mark.parametrize(
    "cls",
    COMMON_METHODS if DESIGN != "router" else [None],
    ids=lambda cls: "router-design" if cls is None else moe_methods.method_id(cls),
)
def test_zero_experts_run_after_recording(monkeypatch: pytest.MonkeyPatch, cls: type | None) -> None:
    """Zero experts (LongCat-style: the router scores E routed + Z zero experts; select_experts designs only,
    vllm-ascend's router factory has no zero-expert routing) are applied after the ids are recorded: the rows
    hold the router's choice as it is, a zero expert as its own id in ``[E, E + Z)`` (the range ``bind_model``
    sizes the layer's capture by, from the backend's ``zero_experts``), so a trainer can replay it; what is
    dispatched has the zero experts mapped away by vllm-ascend."""
    if cls is None:  # the router design routes no zero experts: nothing to record (checked, not assumed)
        factory = importlib.import_module(f"{real_moe.ROUTERS}.router_factory").create_ascend_fused_moe_router
        assert "zero_expert_type" not in inspect.signature(factory).parameters
        return
    moe = build(monkeypatch, cls)
    zero = 2
    moe.experts.zero_expert_num, moe.experts.zero_expert_type = zero, "identity"
    result_cls = type(moe.comm.result(torch.zeros(1)))
    if result_cls is not torch.Tensor:  # apply adds the zero experts' output to what fused_experts returned
        summable = type("SummableResult", (result_cls,), {"__iadd__": _add_to_routed_out})
        monkeypatch.setattr(moe.comm, "result", lambda hidden: summable(routed_out=hidden.clone()))
    # What bind_model sizes the layer's capture by: the backend's count of the layer's zero experts.
    assert ascend.zero_experts(moe.layer) == zero
    buffer = new_capture_buffer(NUM_TOKENS, NUM_LAYERS, real_moe.TOP_K, real_moe.NUM_EXPERTS, "cpu")
    errors = new_error_counter("cpu")
    ascend.bind(moe.layer, LayerCapture(buffer, moe.layer_id, real_moe.NUM_EXPERTS + zero, errors), "zero")
    hidden, logits = inputs(seed=9)
    logits = torch.cat([logits, torch.full((NUM_TOKENS, zero), -9.0)], dim=1)
    logits[::2, real_moe.NUM_EXPERTS] = 9.0  # every other token picks the first zero expert first
    logits[1::4, real_moe.NUM_EXPERTS + 1] = 9.5  # some pick the second
    moe.forward(hidden, logits)
    chosen = real_moe.reference_top_k(logits, real_moe.TOP_K)
    assert (chosen >= real_moe.NUM_EXPERTS).any() and (chosen < real_moe.NUM_EXPERTS).any()
    assert torch.equal(buffer[:, moe.layer_id].long(), chosen)
    assert int(errors) == 0  # zero experts are ids, not invalid ones
    (dispatched,) = moe.comm.dispatched
    assert not torch.equal(dispatched["topk_ids"].long(), chosen)  # zero_experts_compute really ran
    assert int(dispatched["topk_ids"].max()) < real_moe.NUM_EXPERTS


def _add_to_routed_out(result: Any, other: torch.Tensor) -> Any:
    result.routed_out = result.routed_out + other
    return result


def test_the_backends_do_not_claim_each_others_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = next(c for c in METHODS if c.__name__ == "AscendUnquantizedFusedMoEMethod")
    moe = real_moe.build(monkeypatch, real_moe.probe_instance(cls))
    assert ascend.handles(moe.layer) is (DESIGN != "router")
    assert ascend_router.handles(moe.layer) is (DESIGN == "router")
