# SPDX-License-Identifier: Apache-2.0
"""vllm-ascend's real MTP proposer loading its drafter next to a target model: the drafter's MoE layers
(a DeepSeek/GLM-style MTP layer whose id is ``num_hidden_layers``, and one whose id aliases a target
layer) stay out of what the plugin binds, even after the proposer shares the target's embedding and
LM head with the drafter; run after the target in a step, they write no row and trip no guard."""

from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.ascend import real_moe
from vllm_ascend_routing.backends import bind_model
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

NUM_LAYERS, NUM_TOKENS, VOCAB = 4, 6, 32
PROPOSER = "vllm_ascend.spec_decode.eagle_proposer"
BASE = "vllm_ascend.spec_decode.llm_base_proposer"


class Decoder(torch.nn.Module):
    """``model.embed_tokens`` + ``model.layers`` (an MoE layer at each given id) + ``lm_head``."""

    def __init__(self, moe: dict[str, torch.nn.Module]) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, real_moe.HIDDEN)
        self.model.layers = torch.nn.ModuleDict(moe)
        self.lm_head = torch.nn.Linear(real_moe.HIDDEN, VOCAB)


def moe_layer(monkeypatch: pytest.MonkeyPatch, layer_id: int) -> real_moe.RealMoE:
    moe = real_moe.build(monkeypatch, real_moe.probe_instance(real_moe.unquantized_method()), layer_id=layer_id)
    if getattr(moe.layer, "router", None) is None:  # vLLM's layer owns one (the select_experts designs route
        moe.layer.router = SimpleNamespace()  # without it); what the plugin's layer walk looks for
    return moe


class Attention:
    """What the proposer reads of an attention layer in the forward context."""

    def get_kv_cache_spec(self, vllm_config: Any) -> object:
        return object()

    def get_attn_backend(self) -> Any:
        return SimpleNamespace(get_supported_kernel_block_sizes=lambda: [128])


def load_drafter(monkeypatch: pytest.MonkeyPatch, target: torch.nn.Module, drafter: torch.nn.Module) -> Any:
    """``AscendEagleProposer.load_model(target)`` for method ``mtp``, the real code; the drafter's weights
    loader (``_get_model``, which reads a checkpoint) returns ``drafter`` and registers its attention."""
    base = importlib.import_module(BASE)
    attention = {"model.layers.0.self_attn.attn": Attention()}
    monkeypatch.setattr(base, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True, world_size=1))
    monkeypatch.setattr(
        base,
        "get_layers_from_vllm_config",
        lambda config, cls: dict(attention) if cls is base.AttentionLayerBase else {},
    )
    if hasattr(base, "get_ascend_config"):  # 0.27+: the drafter's sliding-window option (off)
        config = SimpleNamespace(draft_window_size=None)
        monkeypatch.setattr(base, "get_ascend_config", lambda: config)
        monkeypatch.setattr(importlib.import_module("vllm_ascend.ascend_config"), "get_ascend_config", lambda: config)
    proposer = object.__new__(importlib.import_module(PROPOSER).AscendEagleProposer)

    def get_model() -> torch.nn.Module:
        attention["model.layers.4.mtp.self_attn.attn"] = Attention()  # the drafter's own KV layer
        return drafter

    for name, value in {
        "method": "mtp",
        "supports_mm_inputs": False,
        "num_speculative_tokens": 1,
        "maybe_eager_context": contextlib.nullcontext(),
        "parallel_drafting": False,
        "use_compress": False,
        "use_cuda_graph": False,
        "_get_model": get_model,
        "vllm_config": SimpleNamespace(
            model_config=SimpleNamespace(is_deepseek_mla=False),
            additional_config={},
            compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(has_full_cudagraphs=lambda: False)),
        ),
    }.items():
        object.__setattr__(proposer, name, value)
    proposer.load_model(target)
    return proposer


def test_mtp_layers_stay_unbound_and_write_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    target_moe = {str(i): moe_layer(monkeypatch, i) for i in (0, 2)}
    mtp_moe = {"4": moe_layer(monkeypatch, NUM_LAYERS), "0": moe_layer(monkeypatch, 0)}  # past / aliasing
    target = Decoder({key: moe.layer for key, moe in target_moe.items()})
    drafter = Decoder({key: moe.layer for key, moe in mtp_moe.items()})
    proposer = load_drafter(monkeypatch, target, drafter)
    assert proposer.model is drafter
    assert drafter.model.embed_tokens is target.model.embed_tokens  # the real sharing ran

    buffer = new_capture_buffer(NUM_TOKENS, NUM_LAYERS, real_moe.TOP_K, real_moe.NUM_EXPERTS, "cpu")
    errors = new_error_counter("cpu")
    bound = bind_model(
        target, lambda layer_id, zero_experts: LayerCapture(buffer, layer_id, real_moe.NUM_EXPERTS, errors)
    )
    backend = "ascend_router" if real_moe.design() == "router" else "ascend"
    assert bound == {backend: 2}  # the target's two MoE layers, none of the drafter's
    guarded = ("forward_impl", "_forward_impl")
    assert all(  # the drafter's forwards carry no guard, its routers no capture hook
        not set(guarded) & set(vars(part)) for moe in mtp_moe.values() for part in (moe.layer, moe.experts)
    )
    if real_moe.design() == "router":
        assert all(moe.router.capture_fn is None for moe in mtp_moe.values())

    generator = torch.Generator().manual_seed(4)
    expected = {}
    for moe in target_moe.values():
        logits = torch.randn(NUM_TOKENS, real_moe.NUM_EXPERTS, generator=generator)
        moe.forward(torch.randn(NUM_TOKENS, real_moe.HIDDEN, generator=generator), logits)
        expected[moe.layer_id] = real_moe.reference_top_k(logits, real_moe.TOP_K)
    recorded = buffer.clone()
    for moe in mtp_moe.values():  # the proposer runs its layers after the target, in the same step
        moe.forward(
            torch.randn(NUM_TOKENS, real_moe.HIDDEN, generator=generator),
            torch.randn(NUM_TOKENS, real_moe.NUM_EXPERTS, generator=generator),
        )
    # every layer really routed and dispatched (one forward context, the last one built: its stub)
    assert len(mtp_moe["0"].comm.dispatched) == 4
    assert torch.equal(buffer, recorded)
    for layer_id, ids in expected.items():
        assert torch.equal(buffer[:, layer_id].long(), ids)
