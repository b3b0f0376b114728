# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_ascend_routing replay-check``: does replaying vLLM's rows close the training-inference gap?

vLLM with the plugin (float32) samples a batch on the embedded tiny MoE and returns each token's log-prob
and routed experts. A "trainer" (``transformers``, bfloat16: another precision, so its own routing really
diverges) then runs ``prompt + output`` twice: natural routing, and routing replayed from vLLM's rows
through the bridge (``replay.align`` → ``replay.to_megatron`` → forced like Megatron's ``RouterReplay``).
For each: routing agreement with vLLM, and the mismatch Δ = log π_train − log π_infer over response tokens.
Passes when replay agrees on every row and its mismatch (mean |Δ| and k3) is strictly below natural routing's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_ascend_routing.preflight import models

TITLE = "vllm-ascend-routing replay-check"
VERDICT = TITLE + ": "  # prefix of the last line
RESULT = "REPLAY_CHECK_RESULT "  # one JSON line for tests


@dataclass
class Sample:
    prompt_ids: list[int]
    output_ids: list[int]
    routed_experts: np.ndarray
    logprobs: list[float]  # vLLM's log-prob of each sampled token


def prompts(count: int) -> list[list[int]]:
    """The batch's prompts: mixed lengths, 8 to 48 tokens (deterministic)."""
    return models.mixed_prompts(count, seed=5, min_len=8, max_len=48)


def sample_with_vllm(arch: str, num_prompts: int, max_tokens: int, mode: str) -> tuple[Any, list[Sample]]:
    """The tiny model's checkpoint info and a sampled batch (temperature 1, seeded) from vLLM + plugin."""
    os.environ["VLLM_ASCEND_ROUTING"] = "1"  # before vLLM is imported: the plugin loads with it
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ASCEND_ROUTING_VALIDATE", "strict")
    from vllm import SamplingParams

    from vllm_ascend_routing.preflight import offline, scenarios

    model = models.build_tiny_moe(arch, scenarios.model_dir() / arch)
    llm = offline.make_llm(model, enforce_eager=(mode == "eager"))
    batch = prompts(num_prompts)
    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=1000 + i)
        for i in range(num_prompts)
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    samples = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [float(completion.logprobs[i][token].logprob) for i, token in enumerate(tokens)]
        routed = np.asarray(offline.routed_rows(llm, output))
        samples.append(Sample(list(output.prompt_token_ids), tokens, routed, logprobs))
    return model, samples


def compare(model_path: Any, samples: list[Sample], dtype: str) -> dict[str, Any]:
    """The trainer's forward on every sample, natural and replayed: routing agreement and mismatch."""
    import transformers

    from vllm_ascend_routing import replay
    from vllm_ascend_routing.preflight.trainer import Mismatch, TrainerModel

    config = transformers.AutoConfig.from_pretrained(str(model_path))
    moe = replay.moe_layers(config)  # what a trainer reads: the config, not the checkpoint's modules
    trainer = TrainerModel(model_path, dtype)
    if moe != trainer.moe_layers:
        raise RuntimeError(f"MoE layers from the config {moe} != the model's routers {trainer.moe_layers}")
    modes = {"natural": Mismatch(), "replay": Mismatch()}
    for sample in samples:
        problems = replay.check(sample.routed_experts, trainer.num_experts, moe)
        if problems:
            raise RuntimeError("vLLM's rows break the contract: " + "; ".join(map(str, problems)))
        prompt_len = len(sample.prompt_ids)
        aligned = replay.align(sample.routed_experts, prompt_len, len(sample.output_ids))
        tokens = sample.prompt_ids + sample.output_ids
        packed = replay.to_megatron([aligned], moe, trainer.num_experts)
        for name, forced in (("natural", None), ("replay", packed)):
            modes[name].add(
                trainer.forward(tokens, forced),
                np.asarray(sample.logprobs),
                aligned.routes,
                aligned.valid,
                moe,
                prompt_len,
            )
    return {
        "moe_layers": list(moe),
        "num_layers": trainer.num_layers,
        "num_experts": trainer.num_experts,
        "top_k": trainer.top_k,
        **{name: mismatch.summary() for name, mismatch in modes.items()},
    }


def verdict(result: dict[str, Any]) -> tuple[bool, str]:
    natural, replayed = result["natural"], result["replay"]
    failures = []
    if replayed["routing_agreement"] != 1.0:
        failures.append(f"replay routing agreement {100 * replayed['routing_agreement']:.2f}%, not 100%")
    for key in ("mean_abs_delta", "k3"):
        if not replayed[key] < natural[key]:
            failures.append(f"replay {key} {replayed[key]:.3g} not below natural routing's {natural[key]:.3g}")
    if failures and natural["routing_agreement"] == 1.0:
        failures.append("natural routing already agrees with vLLM on every row (same precision?): nothing to close")
    if failures:
        return False, "FAIL: " + "; ".join(failures)
    return True, (
        f"PASS (replay: every row as vLLM routed it; k3 {natural['k3'] / max(replayed['k3'], 1e-300):.1f}x "
        f"and mean |Δ| {natural['mean_abs_delta'] / max(replayed['mean_abs_delta'], 1e-300):.1f}x lower "
        "than natural routing)"
    )


def report(result: dict[str, Any]) -> list[str]:
    lines = [
        f"\n{TITLE}: {result['arch']} ({result['num_layers']} layers, MoE layers "
        f"{', '.join(map(str, result['moe_layers']))}; {result['num_experts']} experts, top-{result['top_k']}), "
        f"{result['prompts']} prompts x {result['max_tokens']} sampled tokens (temperature 1)",
        f"inference: vLLM {result['vllm']} + plugin, float32, {result['mode']}; trainer: transformers, "
        f"{result['dtype']}, prompt + output in one forward",
        "",
        f"{'mode':8s} {'routing agreement':>28s} {'mean |Δ|':>10s} {'max |Δ|':>9s} {'k3 KL':>10s} {'|Δ| > ln 2':>11s}",
    ]
    for name in ("natural", "replay"):
        m = result[name]
        agreeing = round(m["routing_agreement"] * m["rows"])
        lines.append(
            f"{name:8s} {100 * m['routing_agreement']:8.2f}% ({agreeing:5d}/{m['rows']:5d} rows) "
            f"{m['mean_abs_delta']:10.5f} {m['max_abs_delta']:9.4f} {m['k3']:10.2e} "
            f"{100 * m['share_abs_delta_over_ln2']:10.2f}%"
        )
    lines.append(
        f"\nrows: (token, MoE layer) pairs of prompt + output[:-1]; Δ = log π_train − log π_infer over "
        f"{result['natural']['tokens']} response tokens; k3 = mean(e^Δ − 1 − Δ)"
    )
    return lines


def run(
    arch: str = "qwen3_moe_dense",
    num_prompts: int = 8,
    max_tokens: int = 32,
    mode: str = "compiled",
    dtype: str = "bfloat16",
) -> int:
    model, samples = sample_with_vllm(arch, num_prompts, max_tokens, mode)
    from vllm_ascend_routing.compat import vllm_version

    result = {
        "arch": arch,
        "prompts": num_prompts,
        "max_tokens": max_tokens,
        "mode": mode,
        "dtype": dtype,
        "vllm": vllm_version(),
        **compare(model.path, samples, dtype),
    }
    ok, detail = verdict(result)
    for line in report(result):
        print(line, flush=True)
    print(RESULT + json.dumps({**result, "ok": ok}), flush=True)
    print(VERDICT + detail, flush=True)
    return 0 if ok else 1
