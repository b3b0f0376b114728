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
the eager direct write on the CPU, the op elsewhere), in microseconds per call (the best of 5 timed blocks: the
machine may be shared), per layout of the capture buffer, beside two floors:
  same place   the cheapest copy of the same ids into the same place of that layout: ``Tensor.copy_`` and, on the
               CPU, NumPy's assignment into the same view (whichever is faster: the ``floor`` column);
  contiguous   the same copy into a contiguous ``[tokens, top_k]`` block of its own.
Layouts:
  token-major  ``[tokens, layers, top_k]`` (the plugin's buffer: a step's rows are what the transport sends, no
               transpose); a layer's rows are strided, one short row per token, so same place != contiguous;
  layer-major  ``[layers, tokens, top_k]`` (vLLM 0.21.0's): each layer a contiguous block (same place =
               contiguous), but the step's rows then need one transpose per step into the token-major rows the
               transport sends; ``+transpose/layer`` is that copy's cost (the cheaper of ATen and NumPy) shared
               among the layers, and ``total`` the layer's write with it.
``rec/floor`` is the capture's cost over the cheapest write its layout allows (goal: within 2x); ``rec/contig``
the cost over the contiguous copy.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
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


def best_of(fn: Callable[[], object], device: str, iters: int, blocks: int = 5) -> float:
    """Seconds per call: the fastest of ``blocks`` timed blocks (another process may take the core for one)."""
    return min(timed(fn, device, iters) for _ in range(blocks))


def numpy_view(tensor: torch.Tensor) -> Any:
    """A CPU tensor's NumPy view (the CPU floor's second candidate); ``None`` elsewhere."""
    return tensor.numpy() if tensor.device.type == "cpu" else None


def floor_of(target: torch.Tensor, ids: torch.Tensor, device: str, iters: int) -> float:
    """The cheapest copy of ``ids`` into ``target``: ``copy_``, and on the CPU NumPy's assignment too."""
    best = best_of(lambda: target.copy_(ids), device, iters)
    target_np, ids_np = numpy_view(target), numpy_view(ids)
    if target_np is not None:
        best = min(best, best_of(lambda: target_np.__setitem__(slice(None), ids_np), device, iters))
    return best


def transpose_cost(layer_major: torch.Tensor, device: str, iters: int) -> float:
    """One step's ``[layers, tokens, top_k]`` -> ``[tokens, layers, top_k]`` copy: the cheaper of ATen and NumPy."""
    rows = torch.empty_like(layer_major.permute(1, 0, 2), memory_format=torch.contiguous_format)
    best = best_of(lambda: rows.copy_(layer_major.permute(1, 0, 2)), device, iters, blocks=3)
    rows_np, layer_major_np = numpy_view(rows), numpy_view(layer_major)
    if rows_np is not None:
        transposed = layer_major_np.transpose(1, 0, 2)
        best = min(best, best_of(lambda: np.copyto(rows_np, transposed), device, iters, blocks=3))
    return best


def write(device: str, tokens: int, top_k: int, layers: int, experts: int) -> None:
    """One layer's write per step, per layout: the recorder against its floors (see module doc)."""
    iters = max(50, min(10000, 2_000_000 // (tokens * top_k)))
    ids = torch.randint(0, experts, (tokens, top_k), dtype=torch.int32, device=device)
    errors = torch.zeros(1, dtype=torch.int64, device=device)
    layer = layers // 2
    contiguous = torch.zeros((tokens, top_k), dtype=OUT_DTYPE, device=device)
    contiguous_s = floor_of(contiguous, ids, device, iters)
    token_major = torch.zeros((tokens, layers, top_k), dtype=OUT_DTYPE, device=device)
    layer_major = torch.zeros((layers, tokens, top_k), dtype=OUT_DTYPE, device=device)
    transpose_s = transpose_cost(layer_major, device, max(5, iters // layers))
    cases = [
        # (layout, the recorder's buffer, its layer there, the place that layer's ids go, per-layer share of the step)
        ("token-major", token_major, layer, token_major[:, layer], 0.0),
        ("layer-major", layer_major[layer].unsqueeze(1), 0, layer_major[layer], transpose_s / layers),
    ]
    for layout, buffer, layer_id, place, extra_s in cases:
        recorder = LayerRecorder(buffer, layer_id, experts, errors)
        recorder_s = best_of(lambda: recorder(ids), device, iters)  # noqa: B023 (called before the loop moves on)
        floor_s = floor_of(place, ids, device, iters)
        place.zero_()
        recorder(ids)
        sync(device)
        if errors.sum().item() or not torch.equal(place, ids.to(OUT_DTYPE)):
            raise SystemExit(f"write: the recorder did not write the ids it was given ({layout})")
        extra = (
            f"  +transpose/layer {extra_s * 1e6:8.2f} us  total {(recorder_s + extra_s) * 1e6:9.2f} us"
            if extra_s
            else ""
        )
        print(
            f"{device:5s} {layout:11s} N={tokens:6d} K={top_k} L={layers}  recorder {recorder_s * 1e6:9.2f} us  "
            f"floor {floor_s * 1e6:9.2f} us  contiguous {contiguous_s * 1e6:9.2f} us  "
            f"rec/floor {recorder_s / floor_s:5.2f}  rec/contig {recorder_s / contiguous_s:5.2f}{extra}",
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
    print("per-layer write (one MoE layer, one step; us per call, best of 5 blocks):")
    for device in devices():
        for tokens in args.write_tokens:
            write(device, tokens, args.top_k, args.layers, args.experts)


if __name__ == "__main__":
    main()
