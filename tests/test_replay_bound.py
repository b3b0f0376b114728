# SPDX-License-Identifier: Apache-2.0
"""The replay bridge's host-memory bound (``replay.to_megatron``): what it allocates stays near the bytes vLLM
returned, whatever the batch (``make bench-handoff`` measures it on production shapes: 1.05x).

What keeps it there: the result is one narrow block (vLLM's dtype or narrower, MoE layers only) and the contract
check widens at most ``_CHECK_IDS`` ids at a time. A check over a whole sample widens it to int64 and sorts it
(about 26x the sample's bytes); this test's input is a few MB, so that shows as several times the input."""

from __future__ import annotations

import tracemalloc

import numpy as np

from vllm_ascend_routing import replay

LAYERS, DENSE, TOP_K, EXPERTS = 61, 3, 8, 256  # DeepSeek-V3's layout: 3 dense layers, then 58 MoE layers
BOUND = 1.25  # peak allocated / vLLM's bytes: the result (58/61 of the input) plus the check's chunks


def vllm_rows(rows: int, seed: int) -> np.ndarray:
    """uint8 ``[rows, LAYERS, TOP_K]`` as vLLM 0.22+ returns it: distinct ids per MoE row, dense layers zero."""
    base = np.random.default_rng(seed).integers(0, EXPERTS, (rows, LAYERS, 1))
    ids = ((base + np.arange(TOP_K) * (EXPERTS // TOP_K)) % EXPERTS).astype(np.uint8)
    ids[:, :DENSE] = 0
    return ids


def test_to_megatron_allocates_little_more_than_vllms_bytes() -> None:
    prompt, output = 1500, 548
    arrays = [vllm_rows(prompt + output - 1, seed) for seed in range(4)]  # 4 samples: 4 MB
    vllm_bytes = sum(array.nbytes for array in arrays)
    moe = list(range(DENSE, LAYERS))
    tracemalloc.start()
    try:
        samples = [replay.align(array, prompt, output) for array in arrays]
        packed = replay.to_megatron(samples, moe, EXPERTS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    result_bytes = packed.ids.numel() * packed.ids.element_size()
    assert result_bytes == len(arrays) * (prompt + output) * len(moe) * TOP_K  # uint8, MoE layers, every token
    assert peak <= BOUND * vllm_bytes, f"peak {peak / vllm_bytes:.2f}x vLLM's {vllm_bytes} bytes (bound {BOUND}x)"
    # The rows it holds are vLLM's, layer for layer (the bound is not bought by skipping work).
    assert np.array_equal(packed.ids[:, : prompt + output - 1].numpy(), arrays[0][:, DENSE:].transpose(1, 0, 2))
