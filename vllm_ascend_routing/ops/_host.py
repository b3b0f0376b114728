# SPDX-License-Identifier: Apache-2.0
"""CPU kernel of ``record_topk_ids``: the same contract as the reference, on NumPy views of the tensors.

Why not the reference on the CPU: each ATen call costs several microseconds of dispatch there, and the
reference's range check, masking and error count are about eight of them per MoE layer per step (86 us a
call on the project's 2-core machine, ~3% of a decode step for 8 MoE layers). Here the common case, every
id in range, is one reduction and one strided copy on zero-copy NumPy views: the range check is a single
``max`` of the ids viewed as unsigned (a negative id becomes a huge unsigned one, so ``id < 0`` and
``id >= limit`` are one comparison). The host reads it does cost nothing: on the CPU the data already is on
the host, so no device is waited for.

In eager mode (not traced) ``LayerCapture`` does not reach this kernel for in-range ids: it writes them
itself into a view taken at bind time (``ops.eager_view``; issue #19, numbers in ``LayerCapture.__call__``).
This kernel serves compiled graphs, the public ``record_topk_ids``, and every batch with an id out of range.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ascend_routing.ops._reference import INVALID, storage_limit

# The id dtypes the op accepts, each with the unsigned type of its width (the one-reduction range check).
_UNSIGNED = {np.dtype(np.int32): np.uint32, np.dtype(np.int64): np.uint64}


def _checked(ids: np.ndarray, limit: int | None, invalid: int, errors: torch.Tensor) -> np.ndarray:
    """``ids``, or a copy with every id outside ``[0, limit)`` replaced by ``invalid`` and counted in
    ``errors[0]`` (viewed only then). No check without ``limit``."""
    if limit is None:
        return ids
    unsigned = _UNSIGNED.get(ids.dtype)
    if unsigned is None:
        raise TypeError(f"record_topk_ids: topk_ids must be int32 or int64, got {ids.dtype}")
    if ids.view(unsigned).max() < limit:
        return ids
    bad = (ids < 0) | (ids >= limit)
    errors.numpy()[0] += int(bad.sum())
    return np.where(bad, invalid, ids)


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
    limit = None if num_experts is None else min(num_experts, storage_limit(out.dtype))
    ids = _checked(ids, limit, INVALID[out.dtype], errors)
    if rows is None:
        dest[: ids.shape[0]] = ids  # unsafe cast narrows like ``Tensor.copy_``
        return
    destination = rows.numpy()
    keep = destination >= 0  # negative rows are padding: skipped
    dest[destination[keep]] = ids[keep]
