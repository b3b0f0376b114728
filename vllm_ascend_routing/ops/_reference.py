# SPDX-License-Identifier: Apache-2.0
"""PyTorch reference of ``record_topk_ids``: the fallback on every device and the test oracle."""

from __future__ import annotations

import torch

from vllm_ascend_routing.ops._id_rule import checked_tensor


def record_topk_ids_reference(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    num_experts: int | None = None,
    errors: torch.Tensor | None = None,
) -> None:
    """Write ``topk_ids`` `[N, K]` into ``out[:N, layer_id]`` (see ``ops.record_topk_ids``)."""
    if topk_ids.shape[0] == 0:
        return
    values = checked_tensor(topk_ids, num_experts, errors)
    out[: values.shape[0], layer_id].copy_(values)  # copy_ narrows to out's dtype
