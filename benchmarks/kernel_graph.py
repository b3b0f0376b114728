#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Device time of the capture's per-layer write inside a CUDA graph, the way vLLM replays its decode steps.

    python benchmarks/kernel_graph.py                       # needs one CUDA GPU; the native kernel if built
    python benchmarks/kernel_graph.py --tokens 64 4096 --layers 61 --top-k 8

``benchmarks/kernel.py`` times calls from the host: on a GPU every number there is the launch and dispatch cost
(about the same at 64 and 65,536 tokens). Here each variant's calls, one per MoE layer of a step, are captured
once in a CUDA graph and the graph replayed, timed with CUDA events: what is left is the device's own time per
layer, as in a graph-captured decode step. Per token count, in microseconds per layer:
  op           ``LayerRecorder`` (what a captured forward runs: the op, its native kernel where built)
  triton       the Triton kernel (what serves CUDA without the native kernel: the pure-Python wheel)
  reference    the op's PyTorch reference (what it replaced there; what ``VLLM_ASCEND_ROUTING_FORCE_REFERENCE`` runs)
  same place   a bare ``copy_`` of the same ids into the same ``[tokens, layers, top_k]`` view: the layout's floor
  contiguous   the same copy into a ``[tokens, top_k]`` block (a layer-major buffer's floor)
and the op's bytes/s (ids read + int16 written). After the replays every layer's rows are compared with the ids.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

from vllm_ascend_routing.ops import OUT_DTYPE, LayerRecorder, kernel_backend
from vllm_ascend_routing.ops._reference import record_topk_ids_reference
from vllm_ascend_routing.ops._triton import record_topk_ids_triton

Call = Callable[[], object]


def graph_us(calls: list[Call], replays: int) -> float:
    """Device microseconds per call: ``calls`` captured once in a CUDA graph, the graph replayed ``replays`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (allocator, lazy initialisation)
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


def measure(tokens: int, top_k: int, layers: int, experts: int, replays: int) -> dict[str, float]:
    """Microseconds per layer for each variant (module doc), and the op's bytes/s under ``op_bytes_per_s``."""
    ids = torch.randint(0, experts, (tokens, top_k), dtype=torch.int32, device="cuda")
    token_major = torch.zeros((tokens, layers, top_k), dtype=OUT_DTYPE, device="cuda")
    layer_major = torch.zeros((layers, tokens, top_k), dtype=OUT_DTYPE, device="cuda")
    errors = torch.zeros(1, dtype=torch.int64, device="cuda")
    recorders = [LayerRecorder(token_major, layer, experts, errors) for layer in range(layers)]
    variants: dict[str, list[Call]] = {
        "op": [partial(recorder, ids) for recorder in recorders],
        "triton": [
            partial(record_topk_ids_triton, ids, token_major, layer, experts, errors) for layer in range(layers)
        ],
        "reference": [
            partial(record_topk_ids_reference, ids, token_major, layer, experts, errors) for layer in range(layers)
        ],
        "same place": [partial(token_major[:, layer].copy_, ids) for layer in range(layers)],
        "contiguous": [partial(layer_major[layer].copy_, ids) for layer in range(layers)],
    }
    timings: dict[str, float] = {}
    for name, calls in variants.items():
        token_major.zero_()
        timings[name] = graph_us(calls, replays)
        expected = ids.to(OUT_DTYPE).unsqueeze(1).expand(tokens, layers, top_k)
        written = layer_major.transpose(0, 1) if name == "contiguous" else token_major
        if not torch.equal(written, expected):
            raise SystemExit(f"{name}: the graph's replays did not write every layer's ids ({tokens} tokens)")
    if int(errors.item()) != 0:
        raise SystemExit(f"in-range ids were counted as invalid: {int(errors.item())}")
    timings["op_bytes_per_s"] = tokens * top_k * (ids.element_size() + 2) / (timings["op"] * 1e-6)
    return timings


def report(tokens: int, timings: dict[str, float], layers: int, top_k: int) -> str:
    return (
        f"cuda graph N={tokens:6d} K={top_k:2d} L={layers:3d}  op {timings['op']:7.2f} us  "
        f"triton {timings['triton']:6.2f} us  reference {timings['reference']:6.2f} us  "
        f"same place {timings['same place']:6.2f} us  "
        f"contiguous {timings['contiguous']:6.2f} us  op/same place {timings['op'] / timings['same place']:5.2f}  "
        f"op/contiguous {timings['op'] / timings['contiguous']:5.2f}  op {timings['op_bytes_per_s'] / 1e9:7.1f} GB/s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 4096, 65536])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--replays", type=int, default=100)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_graph.py needs a CUDA GPU (benchmarks/kernel.py times the CPU)")
    print(f"kernel backend: {kernel_backend()}; {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for tokens in args.tokens:
        timings = measure(tokens, args.top_k, args.layers, args.experts, args.replays)
        print(report(tokens, timings, args.layers, args.top_k), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
