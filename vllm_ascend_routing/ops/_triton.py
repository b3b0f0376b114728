# SPDX-License-Identifier: Apache-2.0
"""A Triton kernel for ``record_topk_ids`` on CUDA, for installs without the native kernel.

Measured on an H100 inside a CUDA graph, the op's PyTorch reference costs about seven small kernels per MoE layer
(15 µs of device time at 64 tokens against 1.3 µs for the native kernel): the pure-Python wheel on a GPU pays that
in every layer of every step. vLLM's CUDA build always brings Triton, so where no native kernel was built this one
kernel serves the CUDA dispatch key instead: the invalid-id rule of ``_id_rule`` (stored as ``INVALID_ID``,
counted once in ``errors``, on the device) and the int16 narrowing, one program per block of ids.

Nothing here imports Triton until the first call (a CPU process never does). Integer arguments are not
specialised on their values, so a new token count never compiles a new variant inside a CUDA-graph capture;
vLLM's warm-up compiles both variants (checked or not, per id dtype) before it captures.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from vllm_ascend_routing.ops._id_rule import INVALID_ID, id_limit

BLOCK = 1024  # ids per program: a decode step's layer fits in one


def available() -> bool:
    """Whether Triton is importable (it is wherever vLLM's CUDA build is)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_ids", "top_k", "id_row", "id_col", "out_row", "out_col", "base", "limit"])
    def record(  # type: ignore[no-untyped-def]
        ids_ptr,
        out_ptr,
        errors_ptr,
        n_ids,
        top_k,
        id_row,
        id_col,
        out_row,
        out_col,
        base,
        limit,
        checked: tl.constexpr,
        invalid: tl.constexpr,
        block: tl.constexpr,
    ):
        index = tl.program_id(0).to(tl.int64) * block + tl.arange(0, block)
        inside = index < n_ids
        token, slot = index // top_k, index % top_k
        ids = tl.load(ids_ptr + token * id_row + slot * id_col, mask=inside, other=0)
        if checked:
            bad = ((ids < 0) | (ids >= limit)) & inside
            ids = tl.where(bad, invalid, ids)
            count = tl.sum(bad.to(tl.int32), axis=0)
            if count > 0:
                tl.atomic_add(errors_ptr, count.to(errors_ptr.dtype.element_ty))
        tl.store(out_ptr + base + token * out_row + slot * out_col, ids.to(tl.int16), mask=inside)

    return record


def record_topk_ids_triton(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    num_experts: int | None,
    errors: torch.Tensor,
) -> None:
    """Write ``topk_ids`` `[N, K]` into ``out[:N, layer_id]`` (see ``ops.record_topk_ids``): one kernel launch."""
    n_ids = topk_ids.numel()
    if n_ids == 0:
        return
    checked = num_experts is not None
    _kernel()[(-(-n_ids // BLOCK),)](
        topk_ids,
        out,
        errors,
        n_ids,
        topk_ids.shape[1],
        topk_ids.stride(0),
        topk_ids.stride(1),
        out.stride(0),
        out.stride(2),
        layer_id * out.stride(1),
        id_limit(num_experts) if num_experts is not None else 0,
        checked=checked,
        invalid=INVALID_ID,
        block=BLOCK,
    )
