# SPDX-License-Identifier: Apache-2.0
"""``doctor --model PATH``: the plugin on the user's own model, with every check it has switched on.

No reference exists for an arbitrary model, so this proves what can be proven without one: vLLM with the plugin
starts on the model and layout the user runs (``--tensor-parallel-size``), every returned array passes strict
validation (shape ``[prompt + output - 1, num_hidden_layers, top_k]``, vLLM's dtype, ids in range), and the
always-on check sees no all-zero row of a bound MoE layer and no invalid id on any worker. Prints, per hidden
layer, the rows returned, the all-zero rows and how many distinct experts were routed to.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):",
    "Translate to French: the weather is nice today.",
    "A mixture-of-experts model routes each token to",
    "In 1905, Albert Einstein published",
    "The three primary colors are",
    "Question: what is 17 times 23? Answer:",
    "Once upon a time in a small village,",
)
CPU_KV_CACHE_BYTES = 512 * 1024 * 1024


@dataclass
class LayerRows:
    rows: int = 0
    zero_rows: int = 0
    experts: set[int] = field(default_factory=set)


def run(
    path: str,
    print_fn: Callable[[str], Any],
    num_prompts: int = 4,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    max_tokens: int = 16,
    mode: str = "compiled",
    trust_remote_code: bool = False,
) -> tuple[bool, str]:
    """Start vLLM with the plugin on ``path``, generate, check; ``(ok, one-line summary or first problem)``."""
    os.environ["VLLM_ASCEND_ROUTING"] = "1"
    os.environ["VLLM_ASCEND_ROUTING_VALIDATE"] = "strict"  # a contract violation raises, naming the request
    # The workers' always-on counters come back through collective_rpc with a function (this process only).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TP 1: the engine in this process
    from vllm import LLM, SamplingParams

    from vllm_ascend_routing.selfcheck import offline

    options: dict[str, Any] = {
        "model": path,
        "tensor_parallel_size": tensor_parallel_size,
        "dtype": offline.platform_dtype() if dtype == "auto" else dtype,
        "enable_return_routed_experts": True,
        "enable_prefix_caching": True,  # vLLM 0.31+ serves routed experts only with it
        "enforce_eager": mode == "eager",
        "max_model_len": 1024,
        "trust_remote_code": trust_remote_code,
        "seed": 0,
    }
    if offline.on_cpu():
        options["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    print_fn(f"model check: {path}, TP {tensor_parallel_size}, {options['dtype']}, {mode}, {num_prompts} prompts")
    llm = LLM(**options)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    num_layers = int(llm.llm_engine.model_config.get_total_num_hidden_layers())
    layers = [LayerRows() for _ in range(num_layers)]
    problems: list[str] = []
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        routed = completion.routed_experts
        tokens = len(output.prompt_token_ids) + len(completion.token_ids) - 1  # the last token is never forwarded
        if routed is None:
            problems.append(f"request {index}: routed_experts is None")
            continue
        array = np.asarray(routed)
        if array.ndim != 3 or array.shape[0] != tokens or array.shape[1] != num_layers:
            problems.append(f"request {index}: shape {array.shape}, expected ({tokens}, {num_layers}, top_k)")
            continue
        for layer, rows in enumerate(array.transpose(1, 0, 2)):
            layers[layer].rows += len(rows)
            layers[layer].zero_rows += int(np.all(rows == 0, axis=-1).sum())
            layers[layer].experts.update(int(e) for e in np.unique(rows))
    totals = offline.sentinel_totals(llm)
    print_fn("  layer    rows  all-zero  experts routed to")
    for layer, seen in enumerate(layers):
        print_fn(f"  {layer:5d}  {seen.rows:6d}  {seen.zero_rows:8d}  {len(seen.experts):6d}")
    checked = f"always-on check: {totals.get('rows_checked', 0)} rows in {totals.get('steps_checked', 0)} steps"
    if totals.get("zero_rows", 0):
        problems.append(f"{totals['zero_rows']} all-zero rows of bound MoE layers (a capture bypassed)")
    if totals.get("invalid_ids", 0):
        problems.append(f"{totals['invalid_ids']} out-of-range expert ids (stored as -1)")
    if not totals.get("rows_checked", 0):
        problems.append("the always-on check saw no row (the workers' counters did not come back)")
    if not any(seen.experts - {0} for seen in layers):
        problems.append("no layer routed to any expert but 0")
    if problems:
        return False, "; ".join(problems)
    moe = sum(1 for seen in layers if seen.zero_rows < seen.rows)
    return True, f"{len(outputs)} requests, {moe}/{num_layers} layers with routing, strict validation passed; {checked}"
