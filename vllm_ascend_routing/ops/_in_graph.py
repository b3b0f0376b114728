# SPDX-License-Identifier: Apache-2.0
"""``record_topk_ids`` as plain ATen ops, for graphs ``torch.compile`` traces on the CPU where no native kernel is
built.

There the op's CPU kernel is the Python host kernel: each call from a compiled graph goes back through the
dispatcher into Python (``make bench-compiled``: 30-46 us per layer inside the graph, 7.6 us called alone).
Written as ``index_put_`` into the buffer, the write is lowered by Inductor into the kernel that already
computes the layer's routing, with the range check, and stores only the step's rows (a slice assignment
instead is functionalized into a rewrite of the whole buffer every step: ``make bench-compiled``'s ``slice``).
The write is a mutation of a graph input, which the compiler keeps (the e2e suite's compiled runs and
``make matrix``'s doctor compare every row). Where a native build serves the CPU the op's C++ kernel is cheaper
still, and devices other than the CPU keep the op (their kernels; graph captures replay it).
"""

from __future__ import annotations

import torch

from vllm_ascend_routing.ops._id_rule import OUT_DTYPE, checked_tensor
from vllm_ascend_routing.ops._library import check_arguments


def record_in_graph(topk_ids: torch.Tensor, out: torch.Tensor, layer_id: int, limit: int, errors: torch.Tensor) -> None:
    """``ops.record_topk_ids(topk_ids, out, layer_id, limit, errors)`` as ATen ops: ids outside ``[0, limit)``
    stored as -1 and counted (``_id_rule``), ``limit`` already capped (``id_limit``)."""
    check_arguments(topk_ids, out, layer_id, errors)
    values = checked_tensor(topk_ids, limit, errors)  # the reference's rule (a capped limit caps to itself)
    rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)
    out.index_put_((rows, torch.full_like(rows, layer_id)), values.to(OUT_DTYPE))
