#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The replay bridge's host memory and time at RL sizes, before and after the narrow bridge, and a rank's shard.

    python benchmarks/handoff.py [--long] [--samples 2]      (make bench-handoff [LONG=1])

Synthetic arrays of the real shapes, as vLLM returns them (distinct ids per MoE row, dense rows zero, the
contract's dtype): DeepSeek-V3 (61 layers, the first 3 dense, top-8 of 256, uint8), Qwen3-235B-A22B (94 MoE
layers, top-8 of 128, uint8), Kimi-K2 (61 layers, the first dense, top-8 of 384, uint16); ``--samples``
samples of 4k and 32k tokens each (``--long``: also 128k; the old bridge takes 2-3 GB per 128k sample). Each
measurement runs in a fresh subprocess: the arrays are made, the process's peak RSS is reset
(``/proc/self/clear_refs``), then ``align`` of every sample and one ``to_megatron`` (``pad_to=4``) run;
printed: peak RSS above the arrays, as a ratio to the input bytes, and the wall time. "before" is the bridge
as of ``BEFORE`` (loaded from ``git show``: the int64 bridge), "after" this checkout's.

Then the bytes one rank materialises under DP 8 x PP 8 x CP 2 (``to_megatron(..., shard=Shard(...))``) for
a step of 8 samples (one per DP rank), the pipeline's layers split as evenly as Megatron's
``pipeline_model_parallel_layout`` allows, against the step's input bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "b63fcf6cd108693bac4e60f30581a0fcc74841eb"  # the last commit with the int64 bridge
TOP_K = 8
# name: (layers, first MoE layer, experts, vLLM's dtype)
MODELS: dict[str, tuple[int, int, int, str]] = {
    "DeepSeek-V3": (61, 3, 256, "uint8"),
    "Qwen3-235B-A22B": (94, 0, 128, "uint8"),
    "Kimi-K2": (61, 1, 384, "uint16"),
}
TOKENS = (4096, 32768)
LONG_TOKENS = 131072
PAD_TO = 4  # TP 1 x CP 2 x 2
DP, PP, CP = 8, 8, 2


def vllm_arrays(model: str, tokens: int, samples: int, seed: int = 0) -> list[np.ndarray]:
    """``samples`` arrays of ``tokens - 1`` rows (prompt_start 0), made a layer at a time (no big temporaries)."""
    layers, first_moe, experts, dtype = MODELS[model]
    rng = np.random.default_rng(seed)
    step = np.arange(TOP_K, dtype=np.int32) * (experts // TOP_K)  # distinct ids in every row
    arrays = []
    for _ in range(samples):
        routed = np.zeros((tokens - 1, layers, TOP_K), dtype=dtype)
        for layer in range(first_moe, layers):
            base = rng.integers(0, experts, tokens - 1, dtype=np.int32)
            routed[:, layer] = (base[:, None] + step) % experts
        arrays.append(routed)
    return arrays


def bridge_module(which: str) -> ModuleType:
    if which == "after":
        from vllm_ascend_routing import replay

        return replay
    source = subprocess.run(
        ["git", "show", f"{BEFORE}:vllm_ascend_routing/replay.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="handoff_before_")) / "replay_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("replay_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> bool:
    """Reset the peak RSS to the current RSS (Linux: clear_refs 5); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def measure(which: str, model: str, tokens: int, samples: int) -> dict[str, Any]:
    """In this (fresh) process: the arrays, then align + to_megatron, peak RSS above the arrays."""
    import torch

    torch.set_num_threads(1)
    bridge = bridge_module(which)
    layers, first_moe, experts, _ = MODELS[model]
    arrays = vllm_arrays(model, tokens, samples)
    input_bytes = sum(a.nbytes for a in arrays)
    moe = list(range(first_moe, layers))
    exact = reset_peak()
    base = rss_kib("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    aligned = [bridge.align(a, tokens // 2, tokens - tokens // 2) for a in arrays]
    data = bridge.to_megatron(aligned, moe, experts, pad_to=PAD_TO)
    seconds = time.perf_counter() - started
    peak = rss_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held = sum(int(t.numel() * t.element_size()) for t in data.indices) if which == "before" else data.ids.nbytes
    return {
        "input_bytes": input_bytes,
        "peak_bytes": (peak - base) * 1024,
        "result_bytes": held,
        "seconds": seconds,
        "peak_exact": exact,
    }


def stage_layers(num_layers: int, stages: int) -> list[list[int]]:
    """Consecutive layers per pipeline stage, as even as possible (the first stages one more)."""
    sizes = [num_layers // stages + (s < num_layers % stages) for s in range(stages)]
    starts = np.cumsum([0, *sizes])
    return [list(range(int(starts[s]), int(starts[s + 1]))) for s in range(stages)]


def shard_bytes(model: str, tokens: int) -> dict[str, Any]:
    """What each (PP stage) rank of DP rank 0, CP rank 0 materialises for a step of DP samples."""
    from vllm_ascend_routing import replay

    layers, first_moe, experts, _ = MODELS[model]
    arrays = vllm_arrays(model, tokens, DP)
    aligned = [replay.align(a, tokens // 2, tokens - tokens // 2) for a in arrays]
    moe = list(range(first_moe, layers))
    per_stage = []
    for stage in stage_layers(layers, PP):
        shard = replay.Shard(dp_rank=0, dp_size=DP, layers=stage, cp_rank=0, cp_size=CP)
        data = replay.to_megatron(aligned, moe, experts, pad_to=PAD_TO, shard=shard)
        per_stage.append(int(data.ids.nbytes + data.valid.numel()))
    return {"step_bytes": sum(a.nbytes for a in arrays), "rank_max": max(per_stage), "rank_min": min(per_stage)}


def child(args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help=f"also {LONG_TOKENS} tokens ('before': 2-3 GB a sample)")
    parser.add_argument("--samples", type=int, default=2, help="samples per measurement (the ratios do not vary)")
    parser.add_argument("--no-before", action="store_true", help="skip the int64 bridge")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, model, tokens = args.child[0], args.child[1], int(args.child[2])
        out = shard_bytes(model, tokens) if kind == "shard" else measure(kind, model, tokens, int(args.child[3]))
        print(json.dumps(out))
        return
    lengths = (*TOKENS, LONG_TOKENS) if args.long else TOKENS
    print(
        f"replay bridge hand-off: align + to_megatron of {args.samples} samples (prompt_start 0, pad_to {PAD_TO}), "
        f"each in a fresh process; before = {BEFORE[:7]} (int64), after = this checkout"
    )
    header = f"{'shape':<28} {'input':>12} {'before peak':>12} {'time':>7} {'after peak':>11} {'time':>7} {'result':>8}"
    print(header)
    worst = 0.0
    for model in MODELS:
        for tokens in lengths:
            after = child(["after", model, str(tokens), str(args.samples)])
            before = None if args.no_before else child(["before", model, str(tokens), str(args.samples)])
            n = after["input_bytes"]
            worst = max(worst, after["peak_bytes"] / n)
            b = "" if before is None else f"{before['peak_bytes'] / n:>11.2f}x {before['seconds']:>6.2f}s"
            print(
                f"{model + f' {tokens // 1024}k x{args.samples}':<28} {mib(n):>12} {b:>20} "
                f"{after['peak_bytes'] / n:>10.2f}x {after['seconds']:>6.2f}s {after['result_bytes'] / n:>7.2f}x"
            )
    print(f"peak RSS above the arrays / input bytes; result: the bridge's output / input. Worst after: {worst:.2f}x")
    print(f"\nper-rank shard, DP {DP} x PP {PP} x CP {CP} (a step of {DP} samples, one per DP rank; pad_to {PAD_TO}):")
    print(f"{'shape':<28} {'step input':>12} {'rank max':>12} {'rank min':>12} {'max / step':>11}")
    for model in MODELS:
        for tokens in lengths:
            shard = child(["shard", model, str(tokens)])
            print(
                f"{model + f' {tokens // 1024}k':<28} {mib(shard['step_bytes']):>12} {mib(shard['rank_max']):>12} "
                f"{mib(shard['rank_min']):>12} {shard['rank_max'] / shard['step_bytes']:>10.4f}"
            )
    print(f"(ideal: 1/(DP*PP*CP) = {1 / (DP * PP * CP):.4f} of the step, plus the rank's mask and padding)")


if __name__ == "__main__":
    main()
