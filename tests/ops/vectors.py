# SPDX-License-Identifier: Apache-2.0
"""Test vectors for record_topk_ids, shared by every backend's tests, and the oracle: the op's contract
written out here again, independently of the package (``ops._id_rule`` is what the host kernel runs, so it
cannot be its own oracle): with ``num_experts``, an id ``v`` is stored when ``0 <= v < min(num_experts, 32767)``
and is -1 (and counted) otherwise; without it, every id is stored as int16; then a plain row-for-row store."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

OUT_DTYPE = torch.int16  # the capture buffer's storage (docs/kernels.md)
STORED_LIMIT = 32767  # ids at or above it cannot be int16 ids next to -1: invalid even for larger models
POISON = 77
NUM_TOKENS = (0, 1, 7, 4096, 65536)
TOP_K = (1, 2, 8, 10)
NUM_LAYERS = (1, 48, 128)


@dataclass
class Case:
    ids: torch.Tensor  # [N, K]
    out: torch.Tensor  # [R, L, K] int16, poisoned
    layer_id: int
    num_experts: int | None

    def expected(self) -> tuple[np.ndarray, int]:
        """(out after the op, number of invalid ids), computed without the op's kernels."""
        out = self.out.numpy().copy()
        ids = self.ids.numpy().astype(np.int64)  # int32 widened: no comparison below can wrap
        if self.num_experts is None:
            out[: ids.shape[0], self.layer_id] = ids.astype(np.int16)
            return out, 0
        valid = (ids >= 0) & (ids < min(self.num_experts, STORED_LIMIT))
        out[: ids.shape[0], self.layer_id] = np.where(valid, ids, -1).astype(np.int16)
        return out, int(ids.size - np.count_nonzero(valid))


def case_ids() -> list[tuple[int, int, torch.dtype, bool]]:
    """(N, K, id dtype, range-checked) combinations; every N and K is covered."""
    return list(itertools.product(NUM_TOKENS, TOP_K, (torch.int32, torch.int64), (True, False)))


def make_case(n: int, k: int, id_dtype: torch.dtype, checked: bool, seed: int) -> Case:
    """Fresh random inputs (seeded per run by the caller). Invalid ids on both sides when checked."""
    gen = torch.Generator().manual_seed(seed)
    num_layers = NUM_LAYERS[seed % len(NUM_LAYERS)]
    layer_id = int(torch.randint(0, num_layers, (1,), generator=gen))
    num_experts = 300
    num_rows = n + 3  # rows past the tokens must keep the poison
    if checked:
        ids = torch.randint(-3, num_experts + 4, (n, k), generator=gen, dtype=torch.int64)
        if id_dtype == torch.int64 and n > 0:
            ids.view(-1)[0] = 2**40 + 5  # wraps into range if narrowed carelessly
    else:
        ids = torch.randint(0, num_experts, (n, k), generator=gen, dtype=torch.int64)
    out = torch.full((num_rows, num_layers, k), POISON, dtype=OUT_DTYPE)
    return Case(ids.to(id_dtype), out, layer_id, num_experts if checked else None)
