# SPDX-License-Identifier: Apache-2.0
"""CPU kernel of ``record_topk_ids``: the same contract as the reference, on NumPy views of the tensors.

Why not the reference on the CPU: each ATen call costs several microseconds of dispatch there, and the
reference's range check, masking and error count are about eight of them per MoE layer per step (86 us a
call on the project's 2-core machine, ~3% of a decode step for 8 MoE layers). Here the common case, every
id in range, is two reductions and one strided copy on zero-copy NumPy views. The host reads it does
(``min``/``max``) cost nothing: on the CPU the data already is on the host, so no device is waited for.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ascend_routing.ops._reference import INVALID, storage_limit


def record_topk_ids_host(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    rows: torch.Tensor | None,
    num_experts: int | None,
    errors: torch.Tensor,
) -> None:
    """Write ``topk_ids`` `[N, K]` into ``out[rows, layer_id]`` (see ``ops.record_topk_ids``); CPU tensors."""
    if topk_ids.shape[0] == 0:
        return
    # Integer tensors never require grad, so .numpy() is always a zero-copy view here.
    ids = topk_ids.numpy()
    dest = out.numpy()[:, layer_id]  # a view: writes land in ``out``
    if num_experts is not None:
        limit = min(num_experts, storage_limit(out.dtype))
        if ids.min() < 0 or ids.max() >= limit:
            bad = (ids < 0) | (ids >= limit)
            ids = np.where(bad, INVALID[out.dtype], ids)
            errors.numpy()[0] += int(bad.sum())
    if rows is None:
        dest[: ids.shape[0]] = ids  # unsafe cast narrows like ``Tensor.copy_``
        return
    destination = rows.numpy()
    keep = destination >= 0  # negative rows are padding: skipped
    dest[destination[keep]] = ids[keep]
