# SPDX-License-Identifier: Apache-2.0
"""The offline scenario doctor's self-check and demo run: one vLLM engine on a tiny MoE, every row checked.

``run_offline`` runs, in one engine: a batch of mixed-length prompts (``batch``), a repeat of the first
prompt served from the prefix cache (``prefix_repeat``), and a prompt longer than
``max_num_batched_tokens`` (``chunked_prefill``). Every returned row is compared with the transformers
reference. The test suite's other scenarios (serving, speculative decoding, data parallel, distributed,
bypass, trainer hand-off) build on it in the test harness, outside the installed package.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from vllm_ascend_routing.preflight import models, offline

MAX_BATCHED_TOKENS = 128
LONG_PROMPT = 300  # > MAX_BATCHED_TOKENS: prefilled in three chunks
MAX_TOKENS = 8


def model_dir() -> Path:
    """Where tiny models are built (cached by recipe)."""
    from vllm_ascend_routing import envs

    return Path(envs.VLLM_ASCEND_ROUTING_MODELS)


def _verdict(result: Any) -> dict[str, Any]:
    return {
        "rows": result.rows,
        "matched": result.matched,
        "near_ties": result.ties,
        "ok": result.ok,
        "problems": result.problems[:5],
    }


def _describe(arrays: list[np.ndarray | None]) -> list[Any]:
    return [None if a is None else {"shape": list(a.shape), "dtype": str(a.dtype)} for a in arrays]


def run_offline(
    arch: str,
    mode: str,
    num_prompts: int,
    tensor_parallel: int = 1,
    dtype: str = "float32",
    after: Callable[[Any], dict[str, Any]] | None = None,
    engine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM (in ``dtype``) on a tiny MoE: a batch, a chunked prefill and its prefix-cached repeat, every row
    against the float32 reference (near-ties by ``dtype``'s rule, counted in each part's ``ties``). ``after``,
    given, runs on the same engine (the ``LLM``) last; its parts join the result (the test harness's oracle run).
    ``engine``: further ``LLM`` arguments (the GPU engine checks' memory, attention and scheduling settings)."""
    binding = offline.cpu_thread_binding(tensor_parallel)  # a NUMA node per CPU worker, or explicit cores
    if binding is not None:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", binding)
    from vllm_ascend_routing.runner_mixin import is_hooked

    model = models.build_tiny_moe(arch, model_dir() / arch)
    llm = offline.make_llm(
        model,
        enforce_eager=(mode == "eager"),
        dtype=dtype,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=True,
        **(
            {"tensor_parallel_size": tensor_parallel, "distributed_executor_backend": "mp"}
            if tensor_parallel > 1
            else {}
        ),
        **(engine or {}),
    )
    reference = offline.reference_for(model)
    prompts = models.mixed_prompts(num_prompts, seed=1)
    out: dict[str, Any] = {"arch": arch, "mode": mode, "tensor_parallel": tensor_parallel, "dtype": dtype}

    batch = offline.generate(llm, prompts, MAX_TOKENS)
    out["batch"] = _verdict(offline.check(reference, model, batch, dtype=dtype))
    out["batch"]["arrays"] = _describe([c.routed_experts for c in batch])
    out["batch"]["output_ids"] = [c.output_ids for c in batch]

    long_prompt = models.mixed_prompts(1, seed=7, min_len=LONG_PROMPT, max_len=LONG_PROMPT)
    (chunked,) = offline.generate(llm, long_prompt, MAX_TOKENS)
    out["chunked_prefill"] = _verdict(offline.check(reference, model, [chunked], dtype=dtype))
    out["chunked_prefill"]["prompt_tokens"] = LONG_PROMPT
    out["chunked_prefill"]["max_num_batched_tokens"] = MAX_BATCHED_TOKENS

    # The long prompt again: its full KV blocks now come from the prefix cache (no forward for them).
    (repeat,) = offline.generate(llm, long_prompt, MAX_TOKENS)
    out["prefix_repeat"] = _verdict(offline.check(reference, model, [repeat], dtype=dtype))
    out["prefix_repeat"]["identical_to_first"] = bool(
        chunked.routed_experts is not None
        and repeat.routed_experts is not None
        and np.array_equal(chunked.routed_experts, repeat.routed_experts)
    )
    out["prefix_repeat"]["cached_tokens"] = repeat.num_cached_tokens
    out["prefix_repeat"]["shared_prompt"] = shared_prompt([chunked, repeat])
    out["multi_turn"] = second_turn(llm, reference, model, chunked, dtype)

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    out["runner_patched"] = is_hooked(GPUModelRunner.load_model)
    out["load_table"] = expert_load(batch, model)
    if after is not None:
        out.update(after(llm))
    out["sentinel"] = offline.sentinel_totals(llm)
    offline.close(llm)  # now: what vLLM logs while stopping comes before what the caller prints next
    return out


def shared_prompt(group: list[offline.Completion]) -> dict[str, Any]:
    """The bridge's GRPO sharing on samples of one prompt served from the prefix cache: rows received and kept."""
    from vllm_ascend_routing import replay

    arrays = [c.routed_experts for c in group]
    if any(a is None for a in arrays):
        return {"error": "no routed_experts"}
    prompt_len = len(group[0].prompt_ids)
    try:
        shared = replay.share_prompt(arrays, prompt_len, [len(c.output_ids) for c in group])  # type: ignore[arg-type]
    except ValueError as error:
        return {"error": str(error)}
    return {
        "samples": len(group),
        "rows_before": sum(len(a) for a in arrays if a is not None),
        "rows_after": len(shared.prompt_rows) + sum(len(r) for r in shared.responses),
        "bytes_before": sum(a.nbytes for a in arrays if a is not None),
        "bytes_after": shared.nbytes,
    }


def second_turn(
    llm: Any, reference: Any, model: models.TinyMoE, first: offline.Completion, dtype: str
) -> dict[str, Any]:
    """A second turn on ``first``'s conversation (its tokens and 5 new ones as the prompt), asking only for the
    new rows where the generation can (0.22+: ``routed_experts_prompt_start``); the conversation's rows, each
    kept once, must be the reference's for every token of the whole conversation."""
    from vllm_ascend_routing import replay

    if first.routed_experts is None:
        return {"error": "no routed_experts"}
    conversation = replay.Conversation()
    conversation.add_turn(first.routed_experts, len(first.prompt_ids), len(first.output_ids), 0)
    context = first.prompt_ids + first.output_ids + models.mixed_prompts(1, seed=11, min_len=5, max_len=5)[0]
    takes_start = replay.ROW_CONTRACTS[first.routed_experts.dtype].takes_prompt_start
    start = conversation.prompt_start if takes_start else 0
    (turn,) = offline.generate(llm, [context], MAX_TOKENS, prompt_start=start)
    if turn.routed_experts is None:
        return {"error": "no routed_experts in the second turn"}
    conversation.add_turn(turn.routed_experts, len(context), len(turn.output_ids), start)
    whole = np.concatenate(conversation.aligned().parts)
    verdict = offline.check(reference, model, [offline.Completion(context, turn.output_ids, whole)], dtype=dtype)
    return {
        "prompt_start": start,
        "rows_received": len(first.routed_experts) + len(turn.routed_experts),
        "rows_if_resent": len(first.routed_experts) + len(context) + len(turn.output_ids) - 1,
        "rows_kept": len(whole),
        **_verdict(verdict),
    }


def expert_load(completions: list[offline.Completion], model: models.TinyMoE) -> dict[str, list[int]]:
    """How many (token, slot) choices each expert received, per MoE layer."""
    table: dict[str, list[int]] = {}
    for layer in model.moe_layers:
        counts = np.zeros(model.num_experts, dtype=np.int64)
        for c in completions:
            if c.routed_experts is not None:
                ids = c.routed_experts[:, layer].astype(np.int64).ravel()
                counts += np.bincount(ids[ids < model.num_experts], minlength=model.num_experts)
        table[str(layer)] = counts.tolist()
    return table
