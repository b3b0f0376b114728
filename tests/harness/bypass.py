# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY bypass stand-ins: engines whose routing capture is bypassed on purpose, to prove the always-on
check (``vllm_ascend_routing.sentinel``) catches what no hook can see. Never installed by the plugin.

``removed-hook``: one MoE layer is counted as bound but its backend hook is never installed (a release where
a hook quietly stops running). ``xlite``: after load, every MoE layer's forward is replaced by a plain-PyTorch
mixture of experts computed from the layer's own weights, so the model serves tokens while the MoE
forward's Python (where every backend hook lives) never runs, as vllm-ascend's xlite runner does.

Both run with validation mode off (production's default): what is reported is the always-on check's. The
stand-in is installed in the worker, wherever vLLM runs it (a process of its own on 0.20.x's CPU build), by
vLLM's own ``worker_extension_cls``: vLLM imports ``RemovedHook`` / ``XliteStyle`` there before it loads the
model; the worker's counters come back through ``collective_rpc``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from vllm_ascend_routing.preflight import models, offline

REMOVED_LAYER = 1  # the layer whose hook the removed-hook engine never installs


def _remove_hook_of(layer_id: int) -> None:
    """Every backend binds as usual, except for ``layer_id``, which it skips (its capture is still counted)."""
    from vllm_ascend_routing import backends

    for _, module in backends.BACKENDS:
        bind = module.bind

        def bind_unless_removed(layer: Any, capture: Any, name: str, bind: Any = bind) -> None:
            if capture.layer_id != layer_id:
                bind(layer, capture, name)

        setattr(module, "bind", bind_unless_removed)  # noqa: B010 (a module of BACKENDS, typed as a Protocol)


def _native_moe(layer: Any, top_k: int, renormalize: bool) -> Any:
    """A forward for vLLM's MoE ``layer`` that never enters its Python: softmax top-k over the router
    logits (the layer's own gate where it owns one), SiLU-gated experts from ``w13_weight`` ``[E, 2I, H]``
    and ``w2_weight`` ``[E, H, I]``."""
    import torch

    # The weights' owner: the layer itself, or its routed-experts submodule (vLLM 0.30+'s MoERunner).
    experts = next(module for module in layer.modules() if hasattr(module, "w13_weight"))

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        hidden: torch.Tensor = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        logits: torch.Tensor = kwargs["router_logits"] if "router_logits" in kwargs else args[1]
        # The gate where the layer owns it (vLLM 0.30+: the layer; 0.23-0.29: its runner).
        gate = getattr(layer, "gate", None) or getattr(getattr(layer, "runner", None), "gate", None)
        if gate is not None and logits.shape[-1] != experts.w13_weight.shape[0]:
            logits = gate(hidden)  # the layer is handed the hidden states and computes the logits itself
            logits = logits[0] if isinstance(logits, tuple) else logits
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(hidden)
        for slot in range(top_k):
            for expert in ids[:, slot].unique().tolist():
                rows = ids[:, slot] == expert
                gate, up = (hidden[rows] @ experts.w13_weight[expert].t()).chunk(2, dim=-1)
                expert_out = (torch.nn.functional.silu(gate) * up) @ experts.w2_weight[expert].t()
                out[rows] += weights[rows, slot, None].to(out.dtype) * expert_out
        return out

    return forward


def _serve_without_moe_python(top_k: int, renormalize: bool) -> None:
    """After binding (the plugin's load hook), replace every MoE layer's forward with ``_native_moe``."""
    from vllm_ascend_routing import backends

    bind_model = backends.bind_model

    def bind_then_bypass(model: Any, make_capture: Any, defer: Any = None) -> dict[str, int]:
        bound = bind_model(model, make_capture, defer)
        for _, layer, _ in backends.moe_layers(model):
            layer.forward = _native_moe(layer, top_k, renormalize)
        return bound

    backends.bind_model = bind_then_bypass  # type: ignore[assignment]


EXTENSIONS = {"removed-hook": "RemovedHook", "xlite": "XliteStyle"}


def install(kind: str) -> None:
    """Install the stand-in ``kind`` in this process (the worker: called when vLLM imports the extension)."""
    if kind == "removed-hook":
        _remove_hook_of(REMOVED_LAYER)
    elif kind == "xlite":
        # The tiny Qwen3-MoE: renormalised top-k (norm_topk_prob), as its config says.
        _serve_without_moe_python(top_k=4, renormalize=True)
    else:
        raise ValueError(f"unknown bypass {kind!r}")


def run_bypass(arch: str, kind: str) -> dict[str, Any]:
    os.environ["VLLM_ASCEND_ROUTING_VALIDATE"] = "0"  # production's default: the check is always on
    # The worker's counters come back through collective_rpc with a function: vLLM's insecure-serialisation switch.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm_ascend_routing import envs

    if arch != "qwen3_moe":
        raise ValueError("the bypass stand-ins are written for the tiny qwen3_moe")
    model = models.build_tiny_moe(arch, Path(envs.VLLM_ASCEND_ROUTING_MODELS) / arch)
    extension = f"{__name__}_{kind.replace('-', '_')}.{EXTENSIONS[kind]}"
    llm = offline.make_llm(model, enforce_eager=True, worker_extension_cls=extension)
    completions = offline.generate(llm, models.mixed_prompts(3, seed=4), 4)
    zero_layers = sorted(
        {
            layer
            for c in completions
            if c.routed_experts is not None
            for layer in model.moe_layers
            if not np.asarray(c.routed_experts)[:, layer].any()
        }
    )
    (worker,) = offline.worker_sentinels(llm)
    return {
        "arch": arch,
        "kind": kind,
        "moe_layers": list(model.moe_layers),
        "zero_layers_returned": zero_layers,
        "stats": worker["stats"],
        "reports": worker["reports"],
        "output_ids": [c.output_ids for c in completions],
    }
