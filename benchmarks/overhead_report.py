# SPDX-License-Identifier: Apache-2.0
"""``make bench``'s report: the ratios of each mode to ``off`` (and of the plugin to vLLM's own path and to
itself unchecked) from the timed rounds, the capture's host memory, the time to assemble one long request's
routing, the py-spy share of plugin code; printed, and returned as the JSON summary ``overhead.py`` writes."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import sampling
from overhead_engine import ARCH, KV_CACHE_BYTES, Engine, engine_method, machine


def capture_memory(num_layers: int, top_k: int, num_experts: int, max_batched: int, kv_slots: int) -> dict[str, int]:
    """Host bytes held by capture buffers for this generation (CPU build: device buffer is host memory)."""
    from vllm_ascend_routing.compat import adapter as get_adapter

    generation = get_adapter().generation.value
    step_buffer = max_batched * num_layers * top_k * 2  # our int16 [max_batched, L, K]
    narrow = 1 if num_experts <= 256 else 2
    if generation == "shm":
        return {"step_buffer": step_buffer, "shared_memory_store": kv_slots * num_layers * top_k * narrow}
    # vLLM's runner mirrors the step buffer in pinned host memory; its scheduler keeps a slot buffer.
    return {
        "step_buffer": step_buffer,
        "pinned_mirror": step_buffer,
        "scheduler_slot_buffer": kv_slots * num_layers * top_k * narrow,
    }


def assemble_16k(num_layers: int = 61, top_k: int = 8, num_experts: int = 256, tokens: int = 16384) -> dict[str, float]:
    """Seconds to assemble one 16k-token request's routing from a KV-slot store, as each generation does."""
    from vllm_ascend_routing.compat.shm import store

    rng = np.random.default_rng(0)
    block = 16
    slots = np.random.default_rng(1).permutation(tokens * 2)[: tokens // block] * block  # scattered blocks
    slot_ids = (slots[:, None] + np.arange(block)[None, :]).ravel()
    spec = store.SegmentSpec.for_engine(f"bench{os.getpid()}", 0, (tokens * 2 * block, num_layers, top_k), num_experts)
    writer = store.SegmentWriter(spec)
    try:
        reader = store.SegmentReader(spec)
        rows = rng.integers(0, num_experts, (tokens, num_layers, top_k), dtype=np.int16)
        writer.write(slot_ids, rows)
        start = time.perf_counter()
        got = reader.read(slot_ids)  # 0.20.x: one read when the request stops, widened to int32
        shm_s = time.perf_counter() - start
        assert np.array_equal(got, rows)
        reader.close()
    finally:
        writer.close()
    # 0.22-0.30 (vLLM's own scheduler code, modelled): prompt rows read from the slot buffer at prefill end,
    # decode rows arrive per step, the output processor concatenates the chunks at finish.
    slot_buffer = np.zeros((tokens * 2 * block, num_layers, top_k), dtype=np.uint8)
    slot_buffer[slot_ids] = rows
    start = time.perf_counter()
    prompt = slot_buffer[slot_ids[: tokens - 128]]
    chunks = [prompt] + [slot_buffer[slot_ids[i : i + 1]] for i in range(tokens - 128, tokens)]
    joined = np.concatenate(chunks, axis=0)
    runner_output_s = time.perf_counter() - start
    assert joined.shape == (tokens, num_layers, top_k)
    return {"shm_read_widen_s": shm_s, "slot_buffer_read_and_concat_s": runner_output_s}


def profile_plugin(engine: Engine, scratch: Path) -> dict[str, Any]:
    """One more timed batch in the plugin engine, sampled by py-spy; the plugin's share of the samples."""
    raw = scratch / "plugin.pyspy.txt"
    with sampling.sampled(engine.pid, raw, rate=200):
        result = engine.run()
    share = sampling.plugin_share(raw.read_text().splitlines())
    return {
        "samples": share.samples,
        "plugin_samples": share.plugin_samples,
        "plugin_share": share.share,
        "step_samples": share.step_samples,
        "plugin_step_samples": share.plugin_step_samples,
        "plugin_step_share": share.step_share,
        "top_functions": share.top(),
        "tokens_per_s_while_sampled": result["tokens_per_s"],
    }


def ratio_text(values: list[float]) -> str:
    return f"median {statistics.median(values):.4f} (rounds: {', '.join(f'{v:.3f}' for v in values)})"


def _paired(base: list[float], other: list[float]) -> list[float]:
    """Round by round: both engines ran in the same round."""
    return [b / a for a, b in zip(base, other, strict=True)]


def summarize(
    args: argparse.Namespace,
    vllm_version: str,
    modes: list[str],
    runs: list[dict[str, Any]],
    profile: dict[str, Any] | None,
    off_baseline: str,
) -> dict[str, Any]:
    """The JSON summary of the timed rounds: median ratios to ``off`` (throughput and tokens per CPU-second),
    the plugin against vLLM's own path and against itself unchecked where those ran, the routing bytes per
    token, the capture's host memory and the long request's assembly time."""
    import tests.harness.model_recipes  # noqa: F401 (the benchmark models' recipes)
    from vllm_ascend_routing.preflight import models, scenarios

    by_mode = {m: [r["tokens_per_s"] for r in runs if r["mode"] == m] for m in modes}
    cpu_by_mode = {m: [r["tokens_per_cpu_s"] for r in runs if r["mode"] == m] for m in modes}
    others = [m for m in modes if m != "off"]
    plugin_run = next(r for r in runs if r["mode"] == "plugin")
    info = models.build_tiny_moe(ARCH, scenarios.model_dir() / ARCH)
    # KV slots the 512 MiB KV budget holds: K and V, every layer, 4 KV heads x 64 dims, float32.
    kv_slots = KV_CACHE_BYTES // (2 * info.num_hidden_layers * 4 * 64 * 4)
    memory = capture_memory(
        info.num_hidden_layers, info.top_k, info.num_experts, plugin_run["max_num_batched_tokens"], kv_slots
    )
    summary: dict[str, Any] = {
        "vllm": vllm_version,
        "machine": machine(),
        "off_baseline": off_baseline,
        "workload": {
            "model": ARCH,
            "requests": args.requests,
            "tokens": args.tokens,
            "engine": engine_method(args),
        },
        "runs": runs,
        "median_ratio_vs_off": {m: statistics.median(_paired(by_mode["off"], by_mode[m])) for m in others},
        "round_ratios_vs_off": {m: _paired(by_mode["off"], by_mode[m]) for m in others},
        "median_cpu_time_ratio_vs_off": {
            m: statistics.median(_paired(cpu_by_mode["off"], cpu_by_mode[m])) for m in others
        },
        "routing_bytes_per_token": plugin_run["routing_bytes_per_token"],
        "capture_host_memory_bytes": memory,
        "assemble_16k_request": assemble_16k(),
        "profile": profile,
    }
    for baseline, key in COMPARED:
        if baseline in by_mode:
            summary[key] = statistics.median(_paired(by_mode[baseline], by_mode["plugin"]))
    return summary


# The engines the plugin is compared with, besides ``off``, and the summary's key for each median ratio.
COMPARED = (
    ("vllm", "median_ratio_plugin_vs_vllm"),
    ("unchecked", "median_ratio_plugin_vs_unchecked"),
    ("before", "median_ratio_plugin_vs_before"),
)


def print_report(summary: dict[str, Any], routing_dtype: str | None) -> None:
    """``summary``'s lines, as ``make bench`` prints them after the rounds (``routing_dtype``: the plugin's
    arrays' dtype, printed with the bytes per token)."""
    runs = summary["runs"]
    by_mode = {m: [r["tokens_per_s"] for r in runs if r["mode"] == m] for m in {r["mode"] for r in runs}}
    cpu_by_mode = {m: [r["tokens_per_cpu_s"] for r in runs if r["mode"] == m] for m in by_mode}
    for mode, ratio in summary["median_ratio_vs_off"].items():
        per_round = ", ".join(f"{r:.3f}" for r in _paired(by_mode["off"], by_mode[mode]))
        print(f"median throughput ratio {mode}/off: {ratio:.4f} (rounds: {per_round})")
    what_of = {"unchecked": " (the always-on check's cost)", "before": " (this checkout against the baseline's)"}
    for baseline, key in COMPARED:
        what = what_of.get(baseline, "")
        if key in summary:
            paired = _paired(by_mode[baseline], by_mode["plugin"])
            print(
                f"median throughput ratio plugin/{baseline}{what}: {summary[key]:.4f} "
                f"(rounds: {', '.join(f'{r:.3f}' for r in paired)})"
            )
    for mode, ratio in summary["median_cpu_time_ratio_vs_off"].items():
        per_round = ", ".join(f"{r:.3f}" for r in _paired(cpu_by_mode["off"], cpu_by_mode[mode]))
        print(f"median tokens-per-CPU-second ratio {mode}/off: {ratio:.4f} (rounds: {per_round})")
    print(f"routing bytes per token: {summary['routing_bytes_per_token']} ({routing_dtype})")
    print(
        "capture host memory (bytes): " + ", ".join(f"{k}={v}" for k, v in summary["capture_host_memory_bytes"].items())
    )
    print(
        "assemble one 16k-token request (61 layers, top-8, 256 experts): "
        + ", ".join(f"{k}={v * 1e3:.2f} ms" for k, v in summary["assemble_16k_request"].items())
    )
    profile = summary["profile"]
    if profile is not None:
        print(
            f"profile (py-spy, one more plugin batch): plugin code {100 * profile['plugin_step_share']:.3f}% of "
            f"the {profile['step_samples']} model-step samples, {100 * profile['plugin_share']:.3f}% of all "
            f"{profile['samples']} engine samples; by function (of all): "
            + ", ".join(f"{name} {100 * share:.3f}%" for name, share in profile["top_functions"])
        )
