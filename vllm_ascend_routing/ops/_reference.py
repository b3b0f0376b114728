# SPDX-License-Identifier: Apache-2.0
"""PyTorch reference of ``record_topk_ids``: the fallback on every device and the test oracle."""

from __future__ import annotations

import torch

# The value an out-of-range id is stored as, per storage dtype (never a wrapped, plausible id).
INVALID = {torch.int16: -1, torch.uint8: 255}


def storage_limit(dtype: torch.dtype) -> int:
    """Number of distinct valid ids a storage dtype holds (ids ``0 .. limit-1``)."""
    if dtype == torch.int16:
        return 32767  # 32767 itself is valid; -1 marks invalid
    if dtype == torch.uint8:
        return 255  # 255 marks invalid
    raise TypeError(f"record_topk_ids: out must be int16 or uint8, got {dtype}")


def record_topk_ids_reference(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    rows: torch.Tensor | None = None,
    num_experts: int | None = None,
    errors: torch.Tensor | None = None,
) -> None:
    """Write ``topk_ids`` `[N, K]` into ``out[rows, layer_id]`` (see ``ops.record_topk_ids``)."""
    if topk_ids.shape[0] == 0:
        return
    values = topk_ids
    if num_experts is not None:
        limit = min(num_experts, storage_limit(out.dtype))
        bad = topk_ids.clamp(0, limit - 1).ne(topk_ids)
        values = topk_ids.masked_fill(bad, INVALID[out.dtype])
        if errors is not None:
            errors.add_(bad.sum())
    if rows is None:
        out[: values.shape[0], layer_id].copy_(values)  # copy_ narrows to out's dtype
        return
    # Negative rows are padding: skipped. (The boolean mask costs a host sync on accelerators; the
    # native kernels avoid it. The capture hot path passes rows=None.)
    keep = rows >= 0
    out[rows[keep].long(), layer_id] = values[keep].to(out.dtype)
