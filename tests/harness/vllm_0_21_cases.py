# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.21.0 (the ``device-cache`` generation): the cases its own transport loses, one engine, every row
against the transformers reference; run with the plugin on and off (what vLLM 0.21.0 alone returns).

    python -m tests.harness.scenarios device-cache --arch qwen3_moe_dense --mode eager

Cases: ``batch`` (mixed prompts, the contract's arrays described), ``stop_string`` (requests ending on a stop
string the front-end finds), ``preemption`` (more concurrent generation than the KV cache holds; vLLM's
preemption counter must move), ``chunked_prefill`` (a prompt over ``max_num_batched_tokens``),
``prefix_cache`` (that prompt again, its blocks from the prefix cache), ``abort`` (a request aborted mid-way
beside two that finish: theirs exact, the aborted one's plugin state freed); then the re-prefill consistency
oracle with its planted faults (``oracle.oracle_part``) on the same engine.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tests.harness import oracle
from vllm_ascend_routing.preflight import models, offline
from vllm_ascend_routing.preflight.scenarios import LONG_PROMPT, MAX_BATCHED_TOKENS, model_dir

BLOCK_SIZE = 32
NUM_BLOCKS = 24  # 768 KV tokens: one long request fits, eight long generations at once do not (preemption)
MAX_MODEL_LEN = 512
PREEMPT_PROMPTS, PREEMPT_PROMPT_LEN, PREEMPT_TOKENS = 8, 60, 64


def _completion(llm: Any, output: Any) -> offline.Completion:
    return offline.Completion(
        list(output.prompt_token_ids),
        list(output.outputs[0].token_ids),
        offline.routed_rows(llm, output),
        int(getattr(output, "num_cached_tokens", 0) or 0),
        offline.native_arrays(output),
    )


def _rows(reference: Any, model: models.TinyMoE, completions: list[offline.Completion]) -> dict[str, Any]:
    """Rows exact / total over the (token, MoE layer) rows the contract owes (a missing array: none exact)."""
    match = offline.check(reference, model, completions)
    owed = sum((len(c.prompt_ids) + len(c.output_ids) - 1) * len(model.moe_layers) for c in completions)
    exact = match.matched if match.rows == owed else 0
    return {"rows": owed, "exact": exact, "ok": match.ok and match.rows == owed, "problems": match.problems[:3]}


def _described(completions: list[offline.Completion]) -> list[Any]:
    described = []
    for c in completions:
        native = c.native or (None, None)
        described.append(
            [None if a is None else {"shape": list(np.shape(a)), "dtype": str(np.asarray(a).dtype)} for a in native]
        )
    return described


def _generate(llm: Any, prompts: list[list[int]], params: list[Any]) -> list[Any]:
    return list(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def _preemptions(llm: Any) -> int:
    return sum(int(getattr(m, "value", 0)) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def run_device_cache(arch: str, mode: str) -> dict[str, Any]:
    from vllm import SamplingParams

    model = models.build_tiny_moe(arch, model_dir() / arch)
    reference = offline.reference_for(model)
    out: dict[str, Any] = {"arch": arch, "mode": mode, "moe_layers": list(model.moe_layers)}
    try:
        llm = offline.make_llm(
            model,
            enforce_eager=(mode == "eager"),
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            enable_prefix_caching=True,
            block_size=BLOCK_SIZE,
            num_gpu_blocks_override=NUM_BLOCKS,
            max_model_len=MAX_MODEL_LEN,
            disable_log_stats=False,
        )
    except Exception as error:  # vLLM 0.21.0 alone on the CPU build: its capturer cannot start
        out["start_error"] = f"{type(error).__name__}: {error}"[-400:]
        return out

    def greedy(n: int, **kwargs: Any) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)

    # batch: the contract's two arrays, described as returned
    prompts = models.mixed_prompts(6, seed=1)
    batch = [_completion(llm, o) for o in _generate(llm, prompts, [greedy(8) for _ in prompts])]
    out["batch"] = {**_rows(reference, model, batch), "arrays": _described(batch)}

    # stop strings: the word of output token 3 (and of token 5) of a first greedy run, as a stop string; the
    # front-end's detokenizer ends the request, which the worker never sees coming
    stop_prompts = models.mixed_prompts(2, seed=5, min_len=20, max_len=30)
    first = _generate(llm, stop_prompts, [greedy(12) for _ in stop_prompts])
    stops = [models.prompt_text([list(o.outputs[0].token_ids)[k]]) for o, k in zip(first, (3, 5), strict=True)]
    stopped = _generate(llm, stop_prompts, [greedy(12, stop=[s]) for s in stops])
    out["stop_string"] = {
        **_rows(reference, model, [_completion(llm, o) for o in stopped]),
        "finish": [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in stopped],
        "output_tokens": [len(o.outputs[0].token_ids) for o in stopped],
    }

    # preemption: eight long generations at once in a KV cache that holds fewer
    before = _preemptions(llm)
    long_prompts = models.mixed_prompts(PREEMPT_PROMPTS, seed=9, min_len=PREEMPT_PROMPT_LEN, max_len=PREEMPT_PROMPT_LEN)
    pre = _generate(llm, long_prompts, [greedy(PREEMPT_TOKENS) for _ in long_prompts])
    out["preemption"] = {
        **_rows(reference, model, [_completion(llm, o) for o in pre]),
        "preemptions": _preemptions(llm) - before,
    }

    # chunked prefill, then the same prompt from the prefix cache
    long_prompt = models.mixed_prompts(1, seed=7, min_len=LONG_PROMPT, max_len=LONG_PROMPT)
    (chunked,) = [_completion(llm, o) for o in _generate(llm, long_prompt, [greedy(8)])]
    out["chunked_prefill"] = {**_rows(reference, model, [chunked]), "prompt_tokens": LONG_PROMPT}
    (repeat,) = [_completion(llm, o) for o in _generate(llm, long_prompt, [greedy(8)])]
    out["prefix_cache"] = {**_rows(reference, model, [repeat]), "cached_tokens": repeat.num_cached_tokens}

    out["abort"] = _abort(llm, reference, model, greedy)
    out["sentinel"] = offline.sentinel_totals(llm)
    out["oracle"] = oracle.oracle_part(llm)  # the re-prefill oracle on the same engine, after the cases
    return out


def _abort(llm: Any, reference: Any, model: models.TinyMoE, greedy: Any) -> dict[str, Any]:
    """Three requests stepped together; one aborted after a few steps: the other two exact."""
    engine = llm.llm_engine
    prompts = models.mixed_prompts(3, seed=13, min_len=20, max_len=40)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, greedy(16))
    finished: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id.split("-")[1]] = output  # "abort-<i>", perhaps with a suffix
        steps += 1
        if steps == 4:
            engine.abort_request(["abort-1"])
    kept = [_completion(llm, finished[str(i)]) for i in (0, 2)]
    return {**_rows(reference, model, kept), "aborted_output": "1" in finished, "steps": steps}


def parse(output: str) -> dict[str, Any]:
    """The scenario's JSON verdict from its process output."""
    line = next(line for line in output.splitlines() if line.startswith("SCENARIO_RESULT "))
    return dict(json.loads(line.removeprefix("SCENARIO_RESULT ")))
