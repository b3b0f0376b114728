# SPDX-License-Identifier: Apache-2.0
"""End-to-end scenarios, one vLLM engine per process, printing a JSON verdict (e2e tests, test-distributed, matrix).

    python -m tests.harness.scenarios offline --arch qwen3_moe --mode compiled
    python -m tests.harness.scenarios serve --arch mixtral
    python -m tests.harness.scenarios verl-handoff --arch qwen3_moe_wide --out DIR

(from the checkout root, or with it on ``PYTHONPATH``: the harness is not part of the installed package).

``offline`` is doctor's and demo's scenario (``vllm_ascend_routing.preflight.scenarios.run_offline``): a batch of
mixed-length prompts (``batch``), a repeat of the first prompt served from the prefix cache (``prefix_repeat``),
and a prompt longer than ``max_num_batched_tokens`` (``chunked_prefill``), every returned row compared with the
transformers reference; the e2e suite's compiled run adds the re-prefill consistency oracle (``oracle.py``).
``serve`` does the same batch through the OpenAI completions API on loopback.
``verl-handoff`` saves vLLM's arrays for verl's R3 code in a trainer environment (``verl_handoff.py``).
``disaggregation`` runs prefill/decode through vLLM's ExampleConnector, producer to consumer (``disaggregation.py``).
``nixl`` runs prefill/decode through vLLM's NixlConnector, both engines alive at once (``nixl_pd.py``);
``mooncake-pd`` through vLLM's MooncakeConnector, rows by transfer id through the row store (``mooncake_pd.py``).
``mooncake-store`` shares KV between two instances through vLLM's MooncakeStoreConnector, rows beside it in the
row store by name (``mooncake_store.py``).
``store`` serves with a row store, this process fetching every request's rows by key (``row_store.py``).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.harness import (
    distributed,
    model_recipes,
    oracle,
    output_features,
    sleep_stand_in,
    verl_handoff,
    weight_reload_suite,
)
from tests.harness.bypass import run_bypass
from tests.harness.data_parallel import run_data_parallel
from tests.harness.disaggregation import run_disaggregation
from tests.harness.mooncake_pd import run_mooncake_pd
from tests.harness.mooncake_store import run_mooncake_store
from tests.harness.nixl_pd import run_nixl
from tests.harness.row_store import run_store
from tests.harness.server import Server, post
from tests.harness.vllm_0_21_cases import run_device_cache
from vllm_ascend_routing import envs, validate
from vllm_ascend_routing.preflight import models, offline

# doctor's scenario and its constants, re-exported: tests and benchmarks name them through this module.
from vllm_ascend_routing.preflight.scenarios import (
    LONG_PROMPT,
    MAX_BATCHED_TOKENS,
    MAX_TOKENS,
    _describe,
    _verdict,
    model_dir,
    run_offline,
)

# The offline runs that also run the re-prefill consistency oracle (tests/harness/oracle.py): the e2e suite's compiled
# run (tests/e2e/test_routed_experts.py RUNS), one per release.
ORACLE_RUNS = {("qwen3_moe_dense", "compiled", 1)}
# The offline runs that also run the output features' checks (tests/harness/output_features.py): one per release.
OUTPUT_RUNS = {("qwen3_moe", "eager", 1)}
SPEC_MAX_TOKENS = [5, 9, 14, 23, 31, 40]  # uneven: requests stop inside accepted draft runs
# Draft slots per sequence must fit max_num_batched_tokens (vLLM's check on some releases).
SPEC_MAX_SEQS = 16


def repetitive_prompts(count: int, seed: int, length: int = 48) -> list[list[int]]:
    """Prompts made of a short n-gram repeated (with a varying tail): the n-gram proposer finds matches."""
    import random

    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        gram = [rng.randrange(10, 500) for _ in range(3 + i % 4)]
        prompt = (gram * (length // len(gram) + 1))[: length - 5 + 2 * i]
        prompts.append(prompt + [rng.randrange(10, 500) for _ in range(i % 3)])
    return prompts


def speculative_config(model: models.TinyMoE, method: str, k: int) -> dict[str, Any] | None:
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if method == "draft":  # a tiny MoE draft model: the target itself, whose layer ids alias the target's
        return {"method": "draft_model", "model": str(model.path), "num_speculative_tokens": k}
    raise ValueError(f"unknown speculative method {method!r}")


# vLLM's speculative-decoding counters (Prometheus adds "_total" to each over HTTP).
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


def spec_decode_counts(llm: Any) -> dict[str, int]:
    """vLLM's own counters, offline: drafts proposed, draft tokens, accepted tokens."""
    values: dict[str, int] = {}
    for metric in llm.get_metrics():  # summed over label sets (one per engine)
        values[metric.name] = values.get(metric.name, 0) + int(getattr(metric, "value", 0))
    return {key: values.get(name, 0) for key, name in SPEC_COUNTERS.items()}


# vLLM's CPU stand-ins for the rejection sampler's Triton kernels out of step with the sampler (vLLM
# 0.20.2: SYNTHETIC_MODE, 0.23.0: USE_FP64_GUMBEL), or its JIT warm-up unable to inspect them (0.30.0).
UPSTREAM_CPU_SPEC_CRASHES = ("_kernel_impl() got an unexpected keyword argument", "Cannot inspect kernel parameters")


def upstream_spec_crash(error: BaseException) -> str | None:
    """The error, if it is vLLM's own CPU speculative-decoding crash (recognised by its message)."""
    text = f"{type(error).__name__}: {error}"
    return text[-300:] if any(sign in text for sign in UPSTREAM_CPU_SPEC_CRASHES) else None


def run_speculative(arch: str, method: str, k: int) -> dict[str, Any]:
    """A batch of repetitive prompts with uneven ``max_tokens``, a chunked prefill and its prefix-cache repeat,
    under speculative decoding ``method`` (``none``: the baseline whose tokens the test compares). Where
    vLLM's own CPU speculative path crashes, says so (``upstream_crash``) instead of a verdict."""
    try:
        return _run_speculative(arch, method, k)
    except Exception as error:
        crash = upstream_spec_crash(error)
        if crash is None:
            raise
        return {"arch": arch, "method": method, "k": k, "upstream_crash": crash}


def _run_speculative(arch: str, method: str, k: int) -> dict[str, Any]:
    model = models.build_tiny_moe(arch, model_dir() / arch)
    llm = offline.make_llm(
        model,
        enforce_eager=True,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=True,
        speculative_config=speculative_config(model, method, k),
        disable_log_stats=False,
        max_num_seqs=SPEC_MAX_SEQS,
    )
    reference = offline.reference_for(model)
    prompts = repetitive_prompts(len(SPEC_MAX_TOKENS), seed=3)
    out: dict[str, Any] = {"arch": arch, "method": method, "k": k}
    batch = offline.generate(llm, prompts, SPEC_MAX_TOKENS)
    out["batch"] = _verdict(offline.check(reference, model, batch))
    out["batch"]["output_ids"] = [c.output_ids for c in batch]
    long_prompt = repetitive_prompts(1, seed=11, length=LONG_PROMPT)
    (chunked,) = offline.generate(llm, long_prompt, 17)
    out["chunked_prefill"] = _verdict(offline.check(reference, model, [chunked]))
    (repeat,) = offline.generate(llm, long_prompt, 17)
    out["prefix_repeat"] = _verdict(offline.check(reference, model, [repeat]))
    out["prefix_repeat"]["cached_tokens"] = repeat.num_cached_tokens
    out["prefix_repeat"]["output_ids"] = repeat.output_ids
    out["spec_decode"] = spec_decode_counts(llm)
    out["sentinel"] = offline.sentinel_totals(llm)
    return out


def run_serve(arch: str, num_prompts: int, spec: str = "none", k: int = 3) -> dict[str, Any]:
    model = models.build_tiny_moe(arch, model_dir() / arch)
    args = [
        "--kv-cache-memory-bytes",
        str(offline.KV_CACHE_BYTES),
        "--max-model-len",
        "1024",
        "--max-num-batched-tokens",
        str(MAX_BATCHED_TOKENS),
        "--enforce-eager",
        "--enable-prefix-caching",
        *output_features.server_args(),
    ]
    config = speculative_config(model, spec, k)
    if config is None:
        prompts, max_tokens = models.mixed_prompts(num_prompts, seed=2), [MAX_TOKENS] * num_prompts
    else:
        args += ["--speculative-config", json.dumps(config), "--max-num-seqs", str(SPEC_MAX_SEQS)]
        prompts, max_tokens = repetitive_prompts(len(SPEC_MAX_TOKENS), seed=5), SPEC_MAX_TOKENS
    with Server(model.path, args) as server:
        reference = offline.reference_for(model)
        completions = []
        for prompt, count in zip(prompts, max_tokens, strict=True):
            reply = post(
                f"{server.url}/v1/completions",
                {
                    "model": str(model.path),
                    "prompt": prompt,
                    "max_tokens": count,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            choice = reply["choices"][0]
            encoded = choice.get("routed_experts")
            array = None if encoded is None else np.load(io.BytesIO(base64.b64decode(encoded)))
            completions.append(offline.Completion(prompt, list(choice["token_ids"]), array))
        result = _verdict(offline.check(reference, model, completions))
        result["arrays"] = _describe([c.routed_experts for c in completions])
        result["output_ids"] = [c.output_ids for c in completions]
        metrics = server.metrics()
        result["spec_decode"] = {key: int(metrics.get(f"{name}_total", 0)) for key, name in SPEC_COUNTERS.items()}
        out: dict[str, Any] = {"arch": arch, "spec": spec, "serve": result}
        if config is None:  # the output features over HTTP (tests/harness/output_features.py), same server
            out["output"] = output_features.serve_part(server.url, model, reference)
        return out


def _after(parts: list[Any]) -> Any:
    def after(llm: Any) -> dict[str, Any]:
        return {key: value for part in parts for key, value in part(llm).items()}

    return after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "scenario",
        choices=[
            "offline",
            "serve",
            "speculative",
            "data-parallel",
            "bypass",
            "distributed",
            "verl-handoff",
            "device-cache",
            "disaggregation",
            "nixl",
            "mooncake-pd",
            "mooncake-store",
            "store",
        ],
    )
    parser.add_argument("--bypass", default="removed-hook", choices=["removed-hook", "xlite"], help="bypass: which")
    parser.add_argument(
        "--layout",
        default="server",
        choices=["server", "headless", "offline"],
        help="data-parallel: one server with both engines, or a second headless process",
    )
    parser.add_argument("--ep", action="store_true", help="data-parallel: with --enable-expert-parallel")
    parser.add_argument("--store", default="shm", choices=["shm", "mooncake"], help="store: shm, or a Mooncake master")
    parser.add_argument("--arch", default="qwen3_moe", choices=model_recipes.ALL_ARCHITECTURES)
    parser.add_argument("--out", default="", help="verl-handoff: where to write the arrays (a folder per model)")
    parser.add_argument("--mode", default="eager", choices=["eager", "compiled"])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (offline)")
    parser.add_argument("--spec", default="none", choices=["none", "ngram", "draft"], help="speculative method")
    parser.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    parser.add_argument(
        "--cases",
        default=",".join(distributed.CASES),
        help="distributed: comma-separated cases (Ray executors, external launcher), see tests/harness/distributed.py",
    )
    args = parser.parse_args()
    if args.scenario == "offline":
        # The re-prefill oracle (clean and each planted fault) on one engine per release, the compiled one; the
        # output features on another. Both are the plugin's: never on a run with it off (test_plugin_off_...).
        run = (args.arch, args.mode, args.tp)
        parts = [
            part
            for runs, part in (
                (ORACLE_RUNS, oracle.oracle_part),
                (OUTPUT_RUNS, output_features.output_part),
                (OUTPUT_RUNS, sleep_stand_in.sleep_part),  # the model unchanged: every row exact after it
                (OUTPUT_RUNS, weight_reload_suite.reload_part),  # last: vLLM's reload may change the model (0.30+)
            )
            if run in runs and envs.VLLM_ASCEND_ROUTING
        ]
        result = run_offline(args.arch, args.mode, args.prompts, args.tp, after=_after(parts) if parts else None)
    elif args.scenario == "data-parallel":
        result = run_data_parallel(args.arch, args.layout, args.mode, args.ep)
    elif args.scenario == "distributed":
        result = distributed.run_distributed(args.arch, args.cases.split(","), args.mode)
    elif args.scenario == "bypass":
        result = run_bypass(args.arch, args.bypass)
    elif args.scenario == "verl-handoff":
        result = verl_handoff.run_verl_handoff(args.arch, Path(args.out), model_dir())
    elif args.scenario == "device-cache":
        result = run_device_cache(args.arch, args.mode)
    elif args.scenario == "disaggregation":
        result = run_disaggregation(args.arch)
    elif args.scenario == "nixl":
        result = run_nixl(args.arch)
    elif args.scenario == "mooncake-pd":
        result = run_mooncake_pd(args.arch, args.store)
    elif args.scenario == "mooncake-store":
        result = run_mooncake_store(args.arch)
    elif args.scenario == "store":
        result = run_store(args.arch, args.store)
    elif args.scenario == "speculative":
        result = run_speculative(args.arch, args.spec, args.k)
    else:
        result = run_serve(args.arch, args.prompts, args.spec, args.k)
    # Arrays validation mode checked in this process (the front-end of in-process engines: offline, speculative).
    result["validated_arrays"] = validate.checked_arrays()
    print("SCENARIO_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
