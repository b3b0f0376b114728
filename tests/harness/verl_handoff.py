# SPDX-License-Identifier: Apache-2.0
"""The vLLM half of the trainer hand-off test: arrays exactly as vLLM returns them, for verl's R3 to replay.

One engine (eager, plugin on, ``enable_return_routed_experts=True``) generates four requests whose
prompt/response shapes stress verl's placement and padding (``SHAPES``). For each request the hand-off
directory keeps vLLM's ``routed_experts`` untouched (its dtype is the contract: uint8 up to 256 experts,
uint16 above), the prompt and output ids, and the transformers reference's top-k for the same tokens; plus
the model's tokenizer (verl pads with the real tokenizer) and what the trainer must build (layers, dense
layers, experts, top-k). ``tests/harness/verl_replay.py`` reads it in a trainer environment (no vLLM there).

    python -m tests.harness.scenarios verl-handoff --arch qwen3_moe_dense --out DIR
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from vllm_ascend_routing.preflight import models, offline

# The models the hand-off covers: uint8 with a dense middle layer, and uint16 (288 experts, dense layer 0).
ARCHITECTURES = ("qwen3_moe_dense", "qwen3_moe_wide")
ARRAYS = "handoff.npz"
META = "meta.json"
TOKENIZER = "tokenizer"

# (name, prompt tokens, response tokens). verl pads every prompt to the longest (left) and every response
# to the longest (right), so each shape lands at another offset of verl's [prompt_pad + response_pad] rows.
SHAPES = (
    ("short_prompt_long_response", 3, 40),
    ("long_prompt_one_token", 60, 1),  # every row is a prompt token; the one response token has no row
    ("equal", 20, 20),
    ("short_response", 10, 5),  # shorter than the longest response: right padding in verl's batch
)
# Below the long prompt, so it is prefilled in two chunks (as long prompts are in production).
MAX_BATCHED_TOKENS = 48
# The same requests again with SamplingParams(routed_experts_prompt_start=...): rows from that prompt token on
# (vLLM 0.22+), for the bridge's recipe (tests/harness/bridge_replay.py), whose rows before it must stay native.
PROMPT_START = 3


def shape_prompts(seed: int = 5) -> list[list[int]]:
    """One prompt per entry of ``SHAPES``, of its length (deterministic token ids)."""
    return [models.mixed_prompts(1, seed=seed + i, min_len=n, max_len=n)[0] for i, (_, n, _) in enumerate(SHAPES)]


def run_verl_handoff(arch: str, out: Path, model_root: Path) -> dict[str, Any]:
    """Generate ``SHAPES`` on ``arch``, save the hand-off directory ``out/arch`` and return a verdict."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"verl-handoff covers {', '.join(ARCHITECTURES)}, not {arch!r}")
    import vllm

    model = models.build_tiny_moe(arch, model_root / arch)
    llm = offline.make_llm(
        model, enforce_eager=True, max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=len(SHAPES)
    )
    prompts = shape_prompts()
    completions = offline.generate(llm, prompts, [response for _, _, response in SHAPES])
    reference = offline.reference_for(model)
    verdict = offline.check(reference, model, completions)
    started = offline.generate(llm, prompts, [response for _, _, response in SHAPES], prompt_start=PROMPT_START)
    verdict_started = offline.check(reference, model, started, prompt_start=PROMPT_START)

    target = out / arch
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    arrays: dict[str, np.ndarray] = {}
    described = []
    for i, ((name, _, _), c) in enumerate(zip(SHAPES, completions, strict=True)):
        if c.routed_experts is None:
            raise RuntimeError(f"request {i} ({name}): vLLM returned no routed_experts")
        arrays[f"routed_{i}"] = c.routed_experts  # as returned: no cast, no copy of another dtype
        arrays[f"prompt_{i}"] = np.asarray(c.prompt_ids, dtype=np.int64)
        arrays[f"output_{i}"] = np.asarray(c.output_ids, dtype=np.int64)
        # The reference routes every token vLLM forwarded: prompt + output[:-1], one row each; its router
        # logits are the trainer's own routing for the bridge's shift check.
        expected, logits = reference.routed_experts_and_logits(c.prompt_ids + c.output_ids[:-1])
        arrays[f"reference_{i}"] = expected
        arrays[f"logits_{i}"] = logits
        routed_start = started[i].routed_experts
        if started[i].output_ids != c.output_ids or routed_start is None:
            raise RuntimeError(f"request {i} ({name}): the prompt_start={PROMPT_START} run generated other tokens")
        arrays[f"routed_start_{i}"] = routed_start
        described.append(
            {
                "shape_name": name,
                "prompt_len": len(c.prompt_ids),
                "output_len": len(c.output_ids),
                "array_shape": list(c.routed_experts.shape),
                "dtype": str(c.routed_experts.dtype),
            }
        )
    np.savez(target / ARRAYS, **arrays)  # type: ignore[arg-type]  # numpy's stubs type **kwds as its flag
    meta = {
        "arch": arch,
        "vllm": vllm.__version__,
        "num_hidden_layers": model.num_hidden_layers,
        "moe_layers": list(model.moe_layers),
        "num_experts": model.num_experts,
        "top_k": model.top_k,
        "prompt_start": PROMPT_START,
        "requests": described,
    }
    (target / META).write_text(json.dumps(meta, indent=1))
    # The trainer pads with the model's own tokenizer (its pad id), as verl's agent loop does.
    tokenizer_dir = target / TOKENIZER
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model.path / name).exists():
            shutil.copy2(model.path / name, tokenizer_dir / name)

    return {
        "arch": arch,
        "dir": str(target),
        "vllm": vllm.__version__,
        "requests": described,
        "rows": verdict.rows,
        "matched": verdict.matched,
        "started": {
            "prompt_start": PROMPT_START,
            "shapes": [list(c.routed_experts.shape) for c in started if c.routed_experts is not None],
            "rows": verdict_started.rows,
            "matched": verdict_started.matched,
            "ok": verdict_started.ok,
            "problems": verdict_started.problems[:5],
        },
        "near_ties": verdict.ties,
        "ok": verdict.ok,
        "problems": verdict.problems[:5],
        "sentinel": offline.sentinel_totals(llm),
    }
