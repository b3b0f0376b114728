# SPDX-License-Identifier: Apache-2.0
"""Test vectors for record_topk_ids, shared by every backend's tests, and an independent NumPy oracle."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

POISON = 77
NUM_TOKENS = (0, 1, 7, 4096, 65536)
TOP_K = (1, 2, 8, 10)
NUM_LAYERS = (1, 48, 128)


@dataclass
class Case:
    ids: torch.Tensor  # [N, K]
    out: torch.Tensor  # [R, L, K], poisoned
    layer_id: int
    rows: torch.Tensor | None
    num_experts: int | None

    def expected(self) -> tuple[np.ndarray, int]:
        """(out after the op, number of out-of-range ids), computed without torch."""
        out = self.out.numpy().copy()
        values = self.ids.numpy().astype(np.int64)
        bad = np.zeros(values.shape, dtype=bool)
        if self.num_experts is not None:
            uint8 = out.dtype == np.uint8
            limit = min(self.num_experts, 255 if uint8 else 32767)
            bad = (values < 0) | (values >= limit)
            values = np.where(bad, 255 if uint8 else -1, values)
        dest = np.arange(values.shape[0]) if self.rows is None else self.rows.numpy().astype(np.int64)
        keep = dest >= 0
        out[dest[keep], self.layer_id] = values[keep].astype(out.dtype)
        return out, int(bad.sum())


def case_ids() -> list[tuple[int, int, torch.dtype, bool, torch.dtype, bool]]:
    """(N, K, id dtype, with rows, out dtype, range-checked) combinations; every N and K is covered."""
    combos = []
    for n, k, id_dtype, with_rows in itertools.product(NUM_TOKENS, TOP_K, (torch.int32, torch.int64), (False, True)):
        for out_dtype, checked in ((torch.int16, True), (torch.uint8, True), (torch.int16, False)):
            combos.append((n, k, id_dtype, with_rows, out_dtype, checked))
    return combos


def make_case(
    n: int, k: int, id_dtype: torch.dtype, with_rows: bool, out_dtype: torch.dtype, checked: bool, seed: int
) -> Case:
    """Fresh random inputs (seeded per run by the caller). Out-of-range ids on both sides when checked."""
    gen = torch.Generator().manual_seed(seed)
    num_layers = NUM_LAYERS[seed % len(NUM_LAYERS)]
    layer_id = int(torch.randint(0, num_layers, (1,), generator=gen))
    num_experts = 200 if out_dtype == torch.uint8 else 300
    num_rows = n + 3
    if checked:
        ids = torch.randint(-3, num_experts + 4, (n, k), generator=gen, dtype=torch.int64)
        if id_dtype == torch.int64 and n > 0:
            ids.view(-1)[0] = 2**40 + 5  # wraps into range if narrowed carelessly
    else:
        ids = torch.randint(0, num_experts, (n, k), generator=gen, dtype=torch.int64)
    rows = None
    if with_rows:
        rows = torch.randperm(num_rows, generator=gen)[:n].to(torch.int64)
        rows[torch.rand(n, generator=gen) < 0.2] = -1
        rows = rows.to(torch.int32 if seed % 2 else torch.int64)
    out = torch.full((num_rows, num_layers, k), POISON, dtype=out_dtype)
    return Case(ids.to(id_dtype), out, layer_id, rows, num_experts if checked else None)
