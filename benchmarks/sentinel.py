#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Per-step cost of the always-on check (``sentinel``) next to the capture itself, in one run.

    python benchmarks/sentinel.py [--layers 8] [--top-k 8] [--experts 64]

For each step size (a 64-token decode batch, a 128-token and a 2048-token prefill) on every device present:
the median time of one step's check (``clear`` before the forward, ``after_forward`` after it: on the CPU the
host check, elsewhere the device packet and its asynchronous copy) and of one step's capture (every MoE layer
records its ids), and their ratio. The defaults are ``make bench``'s model (qwen3_moe_bench: 8 MoE layers,
top-8 of 64 experts); docs/performance.md sets the results against that engine's step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vllm_ascend_routing.capture import LayerCapture, PreparedCapture, new_capture_buffer, new_error_counter


def devices() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    if hasattr(torch, "npu") and torch.npu.is_available():
        found.append("npu")
    return found


def median_seconds(fn: Callable[[], None], device: str, iters: int = 200) -> float:
    def sync() -> None:
        if device != "cpu":
            getattr(torch, device).synchronize()

    for _ in range(10):
        fn()
    samples = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_step(prepared: PreparedCapture, captures: list[LayerCapture], tokens: int, device: str) -> tuple[float, float]:
    """Median seconds of one step's capture and of one step's check, for a ``tokens``-token step."""
    experts, top_k = prepared.num_experts, prepared.buffer.shape[2]
    ids = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)])

    def capture_step() -> None:
        for capture in captures:
            capture(ids)

    def checked_step() -> None:
        prepared.sentinel.clear(tokens)
        capture_step()  # the rows the check reads (their cost is subtracted)
        prepared.sentinel.after_forward(tokens, list)

    capture_s = median_seconds(capture_step, device)
    return capture_s, median_seconds(checked_step, device) - capture_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args()
    for device in devices():
        buffer = new_capture_buffer(8192, args.layers, args.top_k, args.experts, device)
        errors = new_error_counter(device)
        layers = tuple(range(args.layers))
        prepared = PreparedCapture.bound(buffer, errors, args.experts, layers)
        captures = [LayerCapture(buffer, layer, args.experts, errors) for layer in layers]
        for tokens in (64, 128, 2048):
            capture_s, check_s = time_step(prepared, captures, tokens, device)
            print(
                f"{device} {tokens:5d} tokens x {args.layers} layers, top-{args.top_k}: check {check_s * 1e6:7.1f} us "
                f"per step, capture {capture_s * 1e6:7.1f} us, ratio check/capture {check_s / capture_s:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
