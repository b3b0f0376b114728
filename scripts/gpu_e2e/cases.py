#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The engine checks of ``make gpu-e2e``: vLLM with the plugin on, one engine per configuration, one process each.

    python scripts/gpu_e2e/cases.py CASE [--cpu]          # prints GPU_E2E_RESULT {json}; exit 0 only if it passed
    python scripts/gpu_e2e/cases.py bench-worker MODE [--cpu]

Run from the checkout's root with the checkout on ``PYTHONPATH`` (``engine_checks.py`` and ``device_run.py`` start
them). Each offline case is doctor's scenario (``preflight.scenarios.run_offline``: a batch of mixed prompts, a
chunked prefill, its prefix-cached repeat and a second turn, every row against the transformers reference on the
same tiny weights, near-ties by the engine dtype's rule) in one engine configuration, plus what that configuration is
for: the re-prefill consistency oracle with its planted faults (``tests/harness/oracle.py``), a preempting batch, or
speculative decoding (``tests/harness/scenarios.py``'s n-gram workload). Every case also reports the always-on
check's counters (on a GPU its device path: rows checked, zero rows, invalid ids) and the configuration vLLM resolved
(compilation and CUDA-graph mode, async scheduling, attention backend, which kernel served the capture op).

``--cpu`` runs a case on vLLM's CPU build (the dry run that proves the logic here); cases that need a GPU
(``GPU_ONLY``) refuse it. ``bench`` starts one ``bench-worker`` engine per mode (off, vLLM's own capture, the plugin),
waits until the run's other engines are done (``GPU_E2E_QUIET``), then times the same batch in each in turn.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # the checkout's test harness; PYTHONPATH (the runner's choice of copy) comes first

RESULT_PREFIX = "GPU_E2E_RESULT "
# A GPU engine here holds little: a tiny model, a fixed KV cache (no profiling of free memory, which other engines
# on the card would disturb), few sequences (few CUDA-graph sizes to capture). gpu_memory_utilization only has to
# pass vLLM's start-up check that this share of the card is free. Triton attention: the payload carries no
# FlashAttention (and FlashAttention has no float32), so no engine depends on vLLM's automatic choice.
GPU_ENGINE: dict[str, Any] = {
    "gpu_memory_utilization": 0.05,
    "kv_cache_memory_bytes": 256 * 2**20,
    "max_num_seqs": 32,
    "attention_backend": "TRITON_ATTN",
}
BENCH_MODES = ("off", "vllm", "plugin")


@dataclass(frozen=True)
class Case:
    name: str
    arch: str
    mode: str  # "eager" (enforce_eager) or "graphs" (vLLM's default compilation: CUDA graphs on a GPU)
    what: str
    dtype: str = "float32"
    gpu: dict[str, Any] = field(default_factory=dict)  # further LLM arguments on a GPU
    cpu: dict[str, Any] = field(default_factory=dict)  # ... on the CPU build
    oracle: bool = False  # the re-prefill consistency oracle and its planted faults
    preempt: bool = False  # a batch that does not fit the KV cache: preemption, recompute
    reload: bool = False  # vLLM's reload_weights between two runs of the same prompts (preflight/weight_reload.py)
    sleep: bool = False  # last, on a GPU: an RL framework's sleep / wake-up cycle between two runs (``sleep_part``)
    offload: bool = False  # prompts evicted from the KV cache, then loaded back from vLLM's CPU offload tier
    expect_async: bool | None = None  # vLLM's resolved async scheduling, on a GPU
    native: bool = False  # runs on the native CUDA kernel (after the build), else on Triton's


CASES = {
    case.name: case
    for case in (
        Case("eager_f32", "qwen3_moe", "eager", "enforce_eager, float32, async scheduling (vLLM's GPU default)",
             oracle=True, expect_async=True),
        Case("graphs_f32", "qwen3_moe_dense", "graphs",
             "vLLM's default compilation and CUDA graphs, float32, async scheduling, sleep mode on; then vLLM's "
             "reload_weights, then sleep / wake-up at levels 1 and 2", gpu={"enable_sleep_mode": True},
             oracle=True, expect_async=True, reload=True, sleep=True),
        Case("graphs_bf16", "qwen3_moe_robust", "graphs",
             "CUDA graphs, bfloat16, Triton attention, async scheduling", dtype="bfloat16",
             oracle=True, expect_async=True),
        Case("graphs_f32_sync_native", "mixtral", "graphs",
             "CUDA graphs, float32, async scheduling off, the native CUDA kernel",
             gpu={"async_scheduling": False}, expect_async=False, native=True),
        Case("cache_preempt", "qwen3_moe", "graphs",
             "CUDA graphs, prefix caching + chunked prefill + preemption (a KV cache of 768 tokens)",
             gpu={"max_model_len": 512, "num_gpu_blocks_override": 48, "disable_log_stats": False},
             cpu={"max_model_len": 512, "num_gpu_blocks_override": 6, "disable_log_stats": False},
             preempt=True, expect_async=True),
        Case("offload", "qwen3_moe", "graphs",
             "CUDA graphs, vLLM's CPU KV offload (--kv-offloading-size: OffloadingConnector), a KV cache of 768 "
             "tokens: prompts evicted from it come back through the offload tier with the rows the plugin held",
             gpu={"max_model_len": 512, "num_gpu_blocks_override": 48, "kv_offloading_size": 0.25},
             cpu={"max_model_len": 512, "num_gpu_blocks_override": 8}, offload=True, expect_async=True),
    )
}  # fmt: skip
SPEC_CASE, BENCH_CASE = "ngram", "bench"
GPU_ONLY = {"graphs_bf16", "graphs_f32_sync_native"}
# Run only where --only names them (a second call on the warm machine): the first run keeps its budget and its
# benchmark, which waits for every other engine of the run.
ON_REQUEST = ("offload",)
ALL_CASES = (*(name for name in CASES if name not in ON_REQUEST), SPEC_CASE, BENCH_CASE)
KNOWN_CASES = (*ALL_CASES, *ON_REQUEST)


def on_gpu(cpu: bool) -> dict[str, Any]:
    return {} if cpu else dict(GPU_ENGINE)


def engine_facts(llm: Any) -> dict[str, Any]:
    """What vLLM resolved for this engine, and what served the capture op in its worker(s)."""
    config = llm.llm_engine.vllm_config
    compilation = config.compilation_config
    attention = getattr(config, "attention_config", None)
    facts: dict[str, Any] = {
        "compilation_mode": str(getattr(compilation, "mode", None)),
        "cudagraph_mode": str(getattr(compilation, "cudagraph_mode", None)),
        "cudagraph_sizes": len(getattr(compilation, "cudagraph_capture_sizes", None) or []),
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "attention_backend": str(getattr(attention, "backend", None)),
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "block_size": int(config.cache_config.block_size),
    }
    try:
        facts["workers"] = list(llm.collective_rpc(_worker_facts))
    except Exception as error:  # the facts are a report, not a check: say why they are missing
        facts["workers"] = [{"error": f"{type(error).__name__}: {error}"[:300]}]
    return facts


def _worker_facts(worker: Any = None) -> dict[str, Any]:
    """In the worker: the capture op's kernels and the device."""
    import torch

    from vllm_ascend_routing.ops import kernel_backend

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"kernel_backend": kernel_backend(), "device": device, "torch": torch.__version__}


def preemption_part(llm: Any, arch: str, dtype: str) -> dict[str, Any]:
    """16 requests of 96-112 prompt tokens generating 48 each, at once, in a KV cache of 768 tokens: each crosses a
    KV block boundary while decoding (blocks of 16 tokens on a GPU, 128 on the CPU build), when no block is free, so
    vLLM preempts (and recomputes) requests; every row must still be the reference's. vLLM's counter says how many."""
    from vllm_ascend_routing.preflight import models, offline, scenarios

    model = models.build_tiny_moe(arch, scenarios.model_dir() / arch)
    reference = offline.reference_for(model)
    before = metric(llm, "vllm:num_preemptions")
    completions = offline.generate(llm, models.mixed_prompts(16, seed=21, min_len=96, max_len=112), 48)
    part = scenarios._verdict(offline.check(reference, model, completions, dtype=dtype))
    part["preemptions"] = metric(llm, "vllm:num_preemptions") - before
    return {"preemption": part}


def offload_part(llm: Any, arch: str, dtype: str, cpu: bool) -> dict[str, Any]:
    """Four prompts, then four others that take their place in the engine's KV cache (768 tokens: the first four's
    blocks are evicted), then the first four again: their KV comes back from vLLM's CPU offload tier, and the rows of
    those tokens from what the plugin held when they were first computed (carriers.HeldRowsCarrier). Then, after
    another eviction, each first prompt's next turn (prompt, its answer, more tokens): the tier's blocks now reach
    into the answer, whose rows the plugin held too (vLLM 0.22-0.30). Every row against the reference; ``loaded``
    (each request's ``routed_experts_info``) must show rows loaded, past the answer's first token in the next turn.
    The CPU build runs no offload tier: there the part checks its rows only (nothing is loaded)."""
    from vllm_ascend_routing.preflight import models, offline, scenarios

    model = models.build_tiny_moe(arch, scenarios.model_dir() / arch)
    reference = offline.reference_for(model)
    prompts = models.mixed_prompts(4, seed=31, min_len=100, max_len=120)
    first = offline.generate(llm, prompts, 24)
    flood = offline.generate(llm, models.mixed_prompts(4, seed=32, min_len=100, max_len=120), 8)
    again = offline.generate(llm, prompts, 8)
    flood += offline.generate(llm, models.mixed_prompts(4, seed=33, min_len=100, max_len=120), 8)
    extra = models.mixed_prompts(1, seed=34, min_len=16, max_len=16)[0]
    turns = offline.generate(llm, [c.prompt_ids + c.output_ids + extra for c in first], 8)
    part = scenarios._verdict(offline.check(reference, model, first + flood + again + turns, dtype=dtype))
    part["loaded"] = [None if c.info is None else c.info.get("loaded") for c in again]
    part["cached_tokens"] = [c.num_cached_tokens for c in again]
    part["same_tokens"] = sum(a.output_ids[:8] == b.output_ids for a, b in zip(first, again, strict=True))
    part["next_turn_loaded"] = [None if c.info is None else c.info.get("loaded") for c in turns]
    part["next_turn_past_answer"] = sum(  # requests whose loaded tokens reach into their answer (not a local hit)
        c.info is not None and c.info.get("loaded", 0) > 0 and c.info.get("cached", 0) + c.info["loaded"] > len(p)
        for c, p in zip(turns, prompts, strict=True)
    )
    part["tier"] = not cpu
    return {"offload": part}


def metric(llm: Any, name: str) -> int:
    return sum(int(getattr(m, "value", 0) or 0) for m in llm.get_metrics() if m.name == name)


def run_offline_case(case: Case, cpu: bool) -> dict[str, Any]:
    from tests.harness import oracle, weight_reload_suite
    from vllm_ascend_routing.preflight import scenarios

    def after(llm: Any) -> dict[str, Any]:
        parts: dict[str, Any] = {"engine": engine_facts(llm)}
        if case.oracle:
            parts["oracle"] = oracle.oracle_part(llm)
        if case.preempt:
            parts.update(preemption_part(llm, case.arch, case.dtype))
        if case.reload:
            parts.update(weight_reload_suite.reload_part(llm))
        if case.sleep and not cpu:  # vLLM's CPU build has no sleep mode
            parts.update(sleep_part(llm, case.arch, case.dtype))
        if case.offload:
            parts.update(offload_part(llm, case.arch, case.dtype, cpu))
        return parts

    engine = {**on_gpu(cpu), **(case.cpu if cpu else case.gpu)}
    result = scenarios.run_offline(case.arch, case.mode, 10, dtype=case.dtype, after=after, engine=engine)
    result["what"] = case.what
    return result


def sleep_part(llm: Any, arch: str, dtype: str) -> dict[str, Any]:
    """verl's cycle between rollouts, between two runs of the same prompts: sleep at level 1 (weights to host memory,
    KV cache dropped) and wake; sleep at level 2 (all device memory dropped; vLLM restores only the model's
    registered buffers), wake the weights, reload them (as a weight sync does), wake the KV cache. The plugin's capture
    buffer and invalid-id counter live in that device memory: what comes back in them must not read as zero rows or
    invalid ids. An exception is the part's verdict, not the case's end."""
    from vllm_ascend_routing.preflight import weight_reload

    def cycle() -> None:
        llm.sleep(level=1)
        llm.wake_up()
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])

    try:
        return {"sleep": weight_reload.across(llm, arch, cycle, "sleep / wake-up", dtype)}
    except Exception as error:
        return {"sleep": {"label": "sleep / wake-up", "not_run": f"{type(error).__name__}: {error}"[:400]}}


def run_ngram(cpu: bool) -> dict[str, Any]:
    """n-gram speculative decoding (k=3) on repetitive prompts with uneven output lengths, a chunked prefill and its
    prefix-cached repeat (``tests/harness/scenarios.py``'s workload), vLLM's default compilation."""
    from tests.harness import scenarios as harness
    from vllm_ascend_routing.preflight import models, offline, scenarios

    model = models.build_tiny_moe("qwen3_moe", scenarios.model_dir() / "qwen3_moe")
    try:
        llm = offline.make_llm(
            model,
            enforce_eager=cpu,  # the CPU build compiles slowly; on a GPU, CUDA graphs
            max_num_batched_tokens=scenarios.MAX_BATCHED_TOKENS,
            enable_prefix_caching=True,
            speculative_config=harness.speculative_config(model, "ngram", 3),
            disable_log_stats=False,
            **{**on_gpu(cpu), "max_num_seqs": harness.SPEC_MAX_SEQS},
        )
        reference = offline.reference_for(model)
        out: dict[str, Any] = {"arch": model.architecture, "what": "n-gram speculative decoding, k=3"}
        batch = offline.generate(
            llm, harness.repetitive_prompts(len(harness.SPEC_MAX_TOKENS), 3), harness.SPEC_MAX_TOKENS
        )
        out["batch"] = scenarios._verdict(offline.check(reference, model, batch))
        long_prompt = harness.repetitive_prompts(1, seed=11, length=scenarios.LONG_PROMPT)
        (chunked,) = offline.generate(llm, long_prompt, 17)
        out["chunked_prefill"] = scenarios._verdict(offline.check(reference, model, [chunked]))
        (repeat,) = offline.generate(llm, long_prompt, 17)
        out["prefix_repeat"] = scenarios._verdict(offline.check(reference, model, [repeat]))
        out["prefix_repeat"]["cached_tokens"] = repeat.num_cached_tokens
        out["spec_decode"] = harness.spec_decode_counts(llm)
        out["engine"] = engine_facts(llm)
        out["sentinel"] = offline.sentinel_totals(llm)
        return out
    except Exception as error:
        crash = harness.upstream_spec_crash(error)
        if crash is None:
            raise
        return {"what": "n-gram speculative decoding, k=3", "upstream_crash": crash}


def verdict(name: str, result: dict[str, Any], cpu: bool) -> list[str]:
    """What failed in a case's result (empty: passed)."""
    failures = []
    for part, value in result.items():
        if isinstance(value, dict) and "ok" in value and "rows" in value and not value["ok"]:
            failures.append(f"{part}: {value['rows'] - value['matched']} of {value['rows']} rows wrong")
    if "upstream_crash" in result:
        failures.append(f"vLLM's own speculative path crashed: {result['upstream_crash'][:200]}")
    oracle = result.get("oracle")
    if oracle is not None:
        if not oracle["consistency"]["ok"]:
            failures.append(f"re-prefill oracle: {oracle['consistency']['summary']}")
        missed = [k for k, v in oracle["mutations"].items() if v["verdict"] != v["expected"]]
        if missed:
            failures.append(f"re-prefill oracle did not name the planted faults {missed}")
    sentinel = result.get("sentinel")
    if sentinel is not None:
        if not sentinel.get("rows_checked"):
            failures.append("the always-on check counted no rows")
        if sentinel.get("zero_rows") or sentinel.get("invalid_ids"):
            failures.append(f"the always-on check reported {sentinel}")
    case = CASES.get(name)
    from tests.harness import weight_reload_suite  # the suite's verdict: the same tokens where vLLM keeps the model

    for part in ("reload", "sleep"):
        if part in result:
            failures.extend(weight_reload_suite.failures(result[part]))
    if case is not None and case.sleep and not cpu and "sleep" not in result:
        failures.append("the sleep / wake-up part did not run")
    offload = result.get("offload")
    if offload is not None and offload.get("tier"):
        loaded = offload.get("loaded") or []
        if None in loaded or not sum(loaded):
            failures.append(f"nothing was loaded through the offload tier (routed_experts_info loaded: {loaded})")
        if offload.get("same_tokens") != len(loaded):
            failures.append(f"tokens after the reload differ: {offload.get('same_tokens')} of {len(loaded)} the same")
        if not offload.get("next_turn_past_answer"):
            failures.append(
                "no next turn loaded its answer's rows through the offload tier "
                f"(loaded: {offload.get('next_turn_loaded')})"
            )
    if "preemption" in result and not result["preemption"].get("preemptions"):
        failures.append("the preemption batch preempted nothing")
    spec = result.get("spec_decode")
    if spec is not None and not spec.get("accepted_tokens"):
        failures.append(f"speculative decoding accepted no draft token ({spec})")
    engine = result.get("engine", {})
    if not cpu and engine and case is not None:
        if case.expect_async is not None and engine.get("async_scheduling") != case.expect_async:
            failures.append(f"async scheduling {engine.get('async_scheduling')}, expected {case.expect_async}")
        if case.mode == "graphs" and "NONE" in str(engine.get("cudagraph_mode")):
            failures.append(f"CUDA graphs off ({engine.get('cudagraph_mode')})")
        backends = [w.get("kernel_backend", "") for w in engine.get("workers", [])]
        wanted = "native-cuda" if case.native else "triton on cuda"
        if not backends or not all(wanted in b for b in backends):
            failures.append(f"capture op served by {backends}, expected {wanted}")
    return failures


# ---- plugin vs vLLM's own capture vs off, tokens/s ----


def bench_workload(cpu: bool) -> tuple[str, int, int]:
    """(model, requests, tokens per request): the benchmark model on a GPU; a small run on the CPU (the protocol)."""
    return ("qwen3_moe", 8, 8) if cpu else ("qwen3_moe_bench", 64, 64)


def bench_worker(mode: str, cpu: bool) -> None:
    """One engine: warm up, print READY, then one timed batch per ``run`` line on stdin."""
    from vllm import LLM, SamplingParams

    import tests.harness.model_recipes  # noqa: F401 (the benchmark model's recipe)
    from vllm_ascend_routing.preflight import models, scenarios

    arch, requests, tokens = bench_workload(cpu)
    model = models.build_tiny_moe(arch, scenarios.model_dir() / arch)
    memory = {"kv_cache_memory_bytes": 256 * 2**20} if cpu else {**GPU_ENGINE, "kv_cache_memory_bytes": 512 * 2**20}
    llm = LLM(
        model=str(model.path),
        dtype="float32",
        enable_return_routed_experts=mode != "off",
        max_model_len=1024,
        seed=0,
        enforce_eager=cpu,
        **{**memory, "max_num_seqs": max(requests, 32)},
    )
    prompts = [{"prompt_token_ids": p} for p in models.mixed_prompts(requests, seed=3, min_len=16, max_len=256)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    print("BENCH_READY", flush=True)
    for command in sys.stdin:
        if command.strip() != "run":
            break
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        arrays = [o.outputs[0].routed_experts for o in outputs]
        rows, tokens_seen = hashlib.sha256(), hashlib.sha256()
        for output, array in zip(outputs, arrays, strict=True):
            rows.update(b"-" if array is None else array.tobytes())
            tokens_seen.update(json.dumps(list(output.outputs[0].token_ids)).encode())
        result = {"mode": mode, "seconds": seconds, "tokens": generated, "tokens_per_s": generated / seconds}
        result["rows_digest"] = None if all(a is None for a in arrays) else rows.hexdigest()[:16]
        result["tokens_digest"] = tokens_seen.hexdigest()[:16]
        print("BENCH_RESULT " + json.dumps(result), flush=True)


class BenchEngine:
    def __init__(self, mode: str, cpu: bool, log_dir: Path) -> None:
        env = dict(os.environ)
        env.pop("VLLM_ASCEND_ROUTING", None)
        if mode == "plugin":
            env["VLLM_ASCEND_ROUTING"] = "1"
        self.mode = mode
        self.log = (log_dir / f"bench-{mode}.log").open("w")
        command = [sys.executable, __file__, "bench-worker", mode, *(["--cpu"] if cpu else [])]
        self.process = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )

    def expect(self, prefix: str) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"bench engine {self.mode} ended ({self.process.wait()}) before {prefix.strip()}")

    def run(self) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return dict(json.loads(self.expect("BENCH_RESULT ")))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def run_bench(cpu: bool, rounds: int = 3) -> dict[str, Any]:
    """Every mode's engine started (at once on a GPU; one after another on the CPU), then, once the run's other engines
    are done (``GPU_E2E_QUIET`` names a file that appears then), ``rounds`` rounds of one batch per mode, the order
    reversed every other round; median tokens/s per mode and their ratios."""
    log_dir = Path(os.environ.get("GPU_E2E_LOG_DIR", "."))
    engines: dict[str, BenchEngine] = {}
    try:
        for mode in BENCH_MODES:
            engines[mode] = BenchEngine(mode, cpu, log_dir)
            if cpu:
                engines[mode].expect("BENCH_READY")
        if not cpu:
            for engine in engines.values():
                engine.expect("BENCH_READY")
        quiet = os.environ.get("GPU_E2E_QUIET")
        waited = time.monotonic()
        while quiet and not Path(quiet).exists() and time.monotonic() - waited < 600:
            time.sleep(1)
        runs: list[dict[str, Any]] = []
        for index in range(rounds):
            for mode in BENCH_MODES if index % 2 == 0 else BENCH_MODES[::-1]:
                runs.append(engines[mode].run())
    finally:
        for engine in engines.values():
            engine.close()
    arch, requests, tokens = bench_workload(cpu)
    median = {mode: statistics.median(r["tokens_per_s"] for r in runs if r["mode"] == mode) for mode in BENCH_MODES}
    digests = {mode: {r["rows_digest"] for r in runs if r["mode"] == mode} for mode in BENCH_MODES}
    outputs = {mode: {r["tokens_digest"] for r in runs if r["mode"] == mode} for mode in BENCH_MODES}
    # The plugin's rows against vLLM's own capture of the same greedy batch, where both generated the same tokens (two
    # processes need not: vLLM is not batch-invariant by default); on the CPU build vLLM 0.26's own capture is
    # bypassed by the CPU MoE (zeros), so only a GPU compares them.
    comparable = not cpu and outputs["plugin"] == outputs["vllm"] and len(outputs["vllm"]) == 1
    rows_equal = digests["plugin"] == digests["vllm"] and len(digests["vllm"]) == 1 if comparable else None
    return {
        "what": f"{arch}, {requests} requests x {tokens} tokens, float32, {'eager' if cpu else 'CUDA graphs'}",
        "runs": runs,
        "median_tokens_per_s": median,
        "plugin_over_off": median["plugin"] / median["off"],
        "vllm_over_off": median["vllm"] / median["off"],
        "plugin_over_vllm": median["plugin"] / median["vllm"],
        "same_tokens_in_every_mode": len(set.union(*outputs.values())) == 1,
        "plugin_rows_equal_vllms": rows_equal,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("case", choices=[*KNOWN_CASES, "bench-worker"])
    parser.add_argument("mode", nargs="?", choices=BENCH_MODES, help="bench-worker: which engine")
    parser.add_argument("--cpu", action="store_true", help="vLLM's CPU build (the dry run); GPU-only cases refuse")
    args = parser.parse_args(argv)
    if args.case == "bench-worker":
        bench_worker(args.mode, args.cpu)
        return 0
    if args.cpu and args.case in GPU_ONLY:
        parser.error(f"{args.case} needs a GPU")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with this file's functions
    started = time.monotonic()
    if args.case == BENCH_CASE:
        result = run_bench(args.cpu)
        failures = [] if result["plugin_rows_equal_vllms"] in (True, None) else ["the plugin's rows differ from vLLM's"]
    else:
        result = run_ngram(args.cpu) if args.case == SPEC_CASE else run_offline_case(CASES[args.case], args.cpu)
        failures = verdict(args.case, result, args.cpu)
    result.update(case=args.case, seconds=round(time.monotonic() - started, 1), failures=failures, ok=not failures)
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
