#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Benchmark record_topk_ids: achieved bytes/s, side by side with a same-size memcpy, in one run; then the per-layer
write the hot path does, against its floor.

    python benchmarks/kernel.py                 # every device present (CPU always; CUDA/NPU if available)
    python benchmarks/kernel.py --tokens 65536 --top-k 8 --layers 61
    python benchmarks/kernel.py --write-tokens 64 512 4096 65536   # the per-layer write only (--tokens 0 skips the op)

Bytes counted per call: ids read (N*K*id bytes) + ids written (N*K*2 bytes, int16). The baseline copies a
buffer of the same total bytes on the same device (read half, write half). On the CPU the op runs its host
kernel (its PyTorch reference with VLLM_ASCEND_ROUTING_FORCE_REFERENCE=1); elsewhere, without a native
kernel, the reference: the ratio is then that kernel against memcpy.

The per-layer write (``write``): what one MoE layer's capture costs per step, ``LayerRecorder`` (the capture's call:
the eager direct write on the CPU, the op elsewhere), in microseconds per call, beside two floors:
  same place   a bare ``copy_`` of the same ids into the same view of the buffer: the cheapest write the layout allows
               (the buffer is ``[tokens, layers, top_k]``: a layer's rows are strided, one short row per token);
  contiguous   the same copy into a contiguous ``[tokens, top_k]`` block: what a layer-major ``[layers, tokens,
               top_k]`` buffer would give each layer (vLLM 0.21.0's layout), which then needs the step's rows
               transposed once per step (``transpose/layer``: that copy's cost shared among the layers).
``recorder/same place`` is the capture's overhead over the write it has to do (goal: within 2x).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from vllm_ascend_routing.ops import OUT_DTYPE, LayerRecorder, kernel_backend, record_topk_ids


def devices() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    if hasattr(torch, "npu") and torch.npu.is_available():  # torch_npu imported by the user's environment
        found.append("npu")
    return found


def sync(device: str) -> None:
    if device != "cpu":
        getattr(torch, device).synchronize()


def timed(fn: Callable[[], object], device: str, iters: int) -> float:
    for _ in range(3):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


def measure(device: str, tokens: int, top_k: int, layers: int, iters: int) -> tuple[float, float, float, float]:
    """``(op bytes/s, copy bytes/s, op seconds, copy seconds)`` for one shape on ``device``."""
    ids = torch.randint(0, 256, (tokens, top_k), dtype=torch.int32, device=device)
    out = torch.zeros((tokens, layers, top_k), dtype=OUT_DTYPE, device=device)
    errors = torch.zeros(1, dtype=torch.int64, device=device)
    moved = tokens * top_k * (ids.element_size() + out.element_size())
    src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def op() -> None:
        record_topk_ids(ids, out, layers // 2, 256, errors)

    def memcpy() -> None:
        dst.copy_(src)

    op_s = timed(op, device, iters)
    copy_s = timed(memcpy, device, iters)
    return moved / op_s, moved / copy_s, op_s, copy_s


def run(device: str, tokens: int, top_k: int, layers: int, iters: int) -> None:
    op_bw, copy_bw, op_s, copy_s = measure(device, tokens, top_k, layers, iters)
    print(
        f"{device:5s} N={tokens:7d} K={top_k:2d} L={layers:3d}  record_topk_ids {op_bw / 1e9:8.2f} GB/s "
        f"({op_s * 1e6:9.1f} us)  memcpy {copy_bw / 1e9:8.2f} GB/s ({copy_s * 1e6:9.1f} us)  "
        f"ratio {op_bw / copy_bw:.3f}"
    )


def write(device: str, tokens: int, top_k: int, layers: int, experts: int) -> None:
    """One layer's write per step: the recorder against the same-place and the contiguous copy (see module doc)."""
    iters = max(100, min(20000, 4_000_000 // (tokens * top_k)))
    ids = torch.randint(0, experts, (tokens, top_k), dtype=torch.int32, device=device)
    token_major = torch.zeros((tokens, layers, top_k), dtype=OUT_DTYPE, device=device)
    layer_major = torch.zeros((layers, tokens, top_k), dtype=OUT_DTYPE, device=device)
    step_rows = torch.empty((tokens, layers, top_k), dtype=OUT_DTYPE, device=device)
    errors = torch.zeros(1, dtype=torch.int64, device=device)
    layer = layers // 2
    recorder = LayerRecorder(token_major, layer, experts, errors)
    same_place, contiguous = token_major[:, layer], layer_major[layer]
    recorder_s = timed(lambda: recorder(ids), device, iters)
    same_s = timed(lambda: same_place.copy_(ids), device, iters)
    contiguous_s = timed(lambda: contiguous.copy_(ids), device, iters)
    transpose_s = timed(lambda: step_rows.copy_(layer_major.permute(1, 0, 2)), device, max(10, iters // layers))
    if errors.sum().item() or not torch.equal(token_major[:, layer], ids.to(OUT_DTYPE)):
        raise SystemExit("write: the recorder did not write the ids it was given")
    print(
        f"{device:5s} N={tokens:7d} K={top_k:2d} L={layers:3d}  recorder {recorder_s * 1e6:9.2f} us  "
        f"same place {same_s * 1e6:9.2f} us  contiguous {contiguous_s * 1e6:9.2f} us "
        f"(+ transpose/layer {transpose_s / layers * 1e6:8.2f} us)  recorder/same place {recorder_s / same_s:5.2f}  "
        f"recorder/contiguous {recorder_s / contiguous_s:5.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--write-tokens", type=int, nargs="*", default=[64, 512, 4096, 65536])
    parser.add_argument("--experts", type=int, default=256)
    args = parser.parse_args()
    print(f"kernel backend: {kernel_backend()}")
    for device in devices():
        for tokens in filter(None, args.tokens):
            run(device, tokens, args.top_k, args.layers, args.iters)
    print("per-layer write (one MoE layer, one step):")
    for device in devices():
        for tokens in args.write_tokens:
            write(device, tokens, args.top_k, args.layers, args.experts)


if __name__ == "__main__":
    main()
