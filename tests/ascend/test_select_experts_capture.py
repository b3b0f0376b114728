# SPDX-License-Identifier: Apache-2.0
"""Every vllm-ascend MoE quant method, run through the real ``AscendFusedMoE.forward_impl`` (via its MoE
runner) with the multistream gate path off and on, records exactly the router's top-k: the expected ids
come from an independent top-k of the router logits, ``apply`` runs to its end (only the device
communication is stubbed, see ``real_moe``), so EPLB's ``log2phy``, forced load balancing and
``mix_placement`` really execute after the ids were recorded."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from tests.ascend import moe_methods, real_moe
from tests.ascend.conftest import ASCEND_SRC
from vllm_ascend_routing.backends import ascend
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

NUM_TOKENS, NUM_LAYERS = 6, 4
METHODS = moe_methods.method_classes() if ASCEND_SRC else ()


def bound(moe: real_moe.RealMoE) -> torch.Tensor:
    buffer = new_capture_buffer(NUM_TOKENS, NUM_LAYERS, real_moe.TOP_K, real_moe.NUM_EXPERTS, "cpu")
    capture = LayerCapture(buffer, moe.layer_id, real_moe.NUM_EXPERTS, new_error_counter("cpu"))
    assert ascend.handles(moe.layer)
    ascend.bind(moe.layer, capture, moe.layer.layer_name)
    return buffer


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(NUM_TOKENS, real_moe.HIDDEN, generator=generator)
    return hidden, torch.randn(NUM_TOKENS, real_moe.NUM_EXPERTS, generator=generator)


def build(monkeypatch: pytest.MonkeyPatch, cls: type, **kwargs: Any) -> real_moe.RealMoE:
    return real_moe.build(
        monkeypatch, moe_methods.method_instance(cls), layer_cls=moe_methods.layer_class(cls), **kwargs
    )


def test_every_method_is_found_and_none_hides() -> None:
    assert moe_methods.unimportable_method_modules() == {}
    names = {cls.__name__ for cls in METHODS}
    assert "AscendUnquantizedFusedMoEMethod" in names
    assert any("W8A8" in name for name in names), names
    # Inherited apply methods count too (PDMix and FP8-dynamic inherit W8A8-dynamic's apply).
    assert any("apply" not in vars(cls) for cls in METHODS), names


@pytest.mark.parametrize("gate", [False, True], ids=["gate-off", "gate-on"])
@pytest.mark.parametrize("cls", METHODS, ids=moe_methods.method_id)
def test_real_forward_records_the_router_top_k(monkeypatch: pytest.MonkeyPatch, cls: type, gate: bool) -> None:
    moe = build(monkeypatch, cls, gate=gate)
    buffer = bound(moe)
    hidden, logits = inputs(seed=len(cls.__name__) + gate)
    moe.forward(hidden, logits)
    expected = real_moe.reference_top_k(logits, real_moe.TOP_K)
    assert torch.equal(buffer[:, moe.layer_id].long(), expected)
    others = [layer_id for layer_id in range(NUM_LAYERS) if layer_id != moe.layer_id]
    assert (buffer[:, others] == 0).all()  # the layer id comes from the layer
    # apply ran to its end and dispatched the same logical ids; the dispatcher maps them with log2phy,
    # which moves some id, so recording physical ids would have failed the equality above.
    (dispatched,) = moe.comm.dispatched
    assert torch.equal(dispatched["topk_ids"].long(), expected)
    assert dispatched["log2phy"] is moe.layer.log2phy or moe_methods.layer_class(cls) is not None  # 310P: no EPLB
    assert not torch.equal(moe.layer.log2phy[expected].long(), expected)


@pytest.mark.parametrize(
    "cls",
    [c for c in METHODS if c.__name__ in {"AscendUnquantizedFusedMoEMethod", "AscendW8A8DynamicFusedMoEMethod"}],
    ids=moe_methods.method_id,
)
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


def test_mix_placement_keeps_the_routed_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """With mix_placement, select_experts appends the shared expert's id after the routed ones."""
    candidates = [cls for cls in METHODS if "mix_placement" in _apply_source(cls)]
    if not candidates:
        pytest.skip("no MoE method of this vllm-ascend release supports mix_placement")
    moe = build(monkeypatch, candidates[0])
    moe.layer.mix_placement, moe.layer.n_shared_experts = True, 1
    moe.layer.moe_config.num_experts += 1  # the shared expert is placed among the routed ones
    buffer = bound(moe)
    hidden, logits = inputs(seed=7)
    moe.forward(hidden, logits)
    (dispatched,) = moe.comm.dispatched
    assert dispatched["topk_ids"].shape == (NUM_TOKENS, real_moe.TOP_K + 1)  # the shared expert's column
    assert torch.equal(buffer[:, moe.layer_id].long(), real_moe.reference_top_k(logits, real_moe.TOP_K))


def _apply_source(cls: type) -> str:
    import inspect

    return inspect.getsource(cls.apply)  # type: ignore[attr-defined]


def test_a_forward_without_select_experts_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    fused_moe = importlib.import_module(real_moe.FUSED_MOE)
    moe = build(monkeypatch, fused_moe.AscendUnquantizedFusedMoEMethod)
    buffer = bound(moe)
    moe.layer.quant_method.apply = lambda **kwargs: moe.comm.result(kwargs["x"])  # e.g. a fused gating kernel
    with pytest.raises(ascend.RoutingNotRecordedError, match="without calling select_experts"):
        moe.forward(*inputs(seed=1))
    assert (buffer == 0).all()


def test_a_method_that_routes_another_way_is_refused_at_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    fused_moe = importlib.import_module(real_moe.FUSED_MOE)

    class GatingKernelMethod(fused_moe.AscendUnquantizedFusedMoEMethod):  # type: ignore[misc,name-defined]
        def apply(self, **kwargs: Any) -> Any:  # routes in a fused kernel, never calls select_experts
            return kwargs["x"]

    moe = real_moe.build(monkeypatch, real_moe.probe_instance(GatingKernelMethod))
    with pytest.raises(ascend.RoutingNotRecordedError, match="GatingKernelMethod routes without"):
        bound(moe)


@pytest.mark.parametrize("device", ["npu", "cpu"])
def test_recording_adds_one_op_and_no_sync(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Counting, not timing: besides vllm-ascend's own ops, the bound forward dispatches exactly one
    ``record_topk_ids`` and nothing that synchronises with the host. On an NPU the ids are device tensors,
    so ``LayerCapture`` never takes its eager CPU write (simulated here: no eager view at bind); with the
    stubbed CPU tensors of this suite it does, and adds exactly the direct write's ops."""
    from tests.test_hot_path import EAGER_CAPTURE_OPS, OpLog
    from vllm_ascend_routing import capture

    fused_moe = importlib.import_module(real_moe.FUSED_MOE)
    hidden, logits = inputs(seed=11)

    def forward_ops(bind: bool) -> list[str]:
        with monkeypatch.context() as patch:
            moe = real_moe.build(patch, real_moe.probe_instance(fused_moe.AscendUnquantizedFusedMoEMethod))
            if bind:
                if device == "npu":
                    patch.setattr(capture, "eager_view", lambda out, layer_id: None)
                bound(moe)
            with OpLog() as log:
                moe.forward(hidden, logits)
        return log.ops

    unbound, with_capture = forward_ops(bind=False), forward_ops(bind=True)
    added = list(with_capture)
    for op in unbound:
        added.remove(op)
    if device == "npu":
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
    """A draft model's (or MTP module's) MoE layer is never bound: calling the patched select_experts from
    its real forward records nothing, even when its layer id aliases a bound target layer (a draft model's
    layers start at 0; Qwen3-Next MTP is mtp.layers.0), and raises nothing (DeepSeek/GLM MTP ids start at
    num_hidden_layers)."""
    fused_moe = importlib.import_module(real_moe.FUSED_MOE)
    target = real_moe.build(monkeypatch, real_moe.probe_instance(fused_moe.AscendUnquantizedFusedMoEMethod))
    buffer = bound(target)
    hidden, logits = inputs(seed=21)
    target.forward(hidden, logits)
    recorded = buffer.clone()
    draft = real_moe.build(monkeypatch, real_moe.probe_instance(fused_moe.AscendUnquantizedFusedMoEMethod))
    draft.layer.layer_name = draft_layer_name
    draft_hidden, draft_logits = inputs(seed=22)
    draft.forward(draft_hidden, draft_logits)  # the drafter runs after the target in the same step
    (dispatched,) = draft.comm.dispatched
    assert torch.equal(dispatched["topk_ids"].long(), real_moe.reference_top_k(draft_logits, real_moe.TOP_K))
    assert torch.equal(buffer, recorded)
    assert torch.equal(buffer[:, target.layer_id].long(), real_moe.reference_top_k(logits, real_moe.TOP_K))


@pytest.mark.parametrize(
    "cls",
    [c for c in METHODS if c.__name__ in {"AscendUnquantizedFusedMoEMethod", "AscendW8A8DynamicFusedMoEMethod"}],
    ids=moe_methods.method_id,
)
def test_zero_experts_run_after_recording(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    """Zero experts (LongCat-style: the router scores E routed + Z zero experts) are applied after the
    ids are recorded: the rows hold the router's choice, where a zero expert (an id >= E, past the
    expert count the capture is sized by) is stored as the explicit invalid marker (-1), never as a
    plausible id; what is dispatched has the zero experts mapped away by vllm-ascend."""
    moe = build(monkeypatch, cls)
    moe.layer.zero_expert_num, moe.layer.zero_expert_type = 1, "identity"
    result_cls = getattr(importlib.import_module(real_moe.FUSED_MOE), "FusedExpertsResult", None)
    if result_cls is not None:  # apply adds the zero experts' output to what fused_experts returned
        summable = type("SummableResult", (result_cls,), {"__iadd__": _add_to_routed_out})
        monkeypatch.setattr(moe.comm, "result", lambda hidden: summable(routed_out=hidden.clone()))
    buffer = bound(moe)
    hidden, logits = inputs(seed=9)
    logits = torch.cat([logits, torch.full((NUM_TOKENS, 1), -9.0)], dim=1)
    logits[::2, real_moe.NUM_EXPERTS] = 9.0  # every other token picks the zero expert first
    moe.forward(hidden, logits)
    chosen = real_moe.reference_top_k(logits, real_moe.TOP_K)
    expected = chosen.masked_fill(chosen >= real_moe.NUM_EXPERTS, -1)
    assert (expected == -1).any() and (expected >= 0).any()
    assert torch.equal(buffer[:, moe.layer_id].long(), expected)
    (dispatched,) = moe.comm.dispatched
    assert not torch.equal(dispatched["topk_ids"].long(), chosen)  # zero_experts_compute really ran
    assert int(dispatched["topk_ids"].max()) < real_moe.NUM_EXPERTS


def _add_to_routed_out(result: Any, other: torch.Tensor) -> Any:
    result.routed_out = result.routed_out + other
    return result
