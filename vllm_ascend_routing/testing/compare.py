# SPDX-License-Identifier: Apache-2.0
"""Exact comparison of vLLM's returned routed experts with the reference, per (token, MoE layer) row."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Match:
    """Row counts of one comparison; ``ok`` only when every row is identical and shapes agree."""

    rows: int = 0
    matched: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.matched == self.rows and self.rows > 0

    @property
    def rate(self) -> float:
        return self.matched / self.rows if self.rows else 0.0

    def add(self, other: Match) -> None:
        self.rows += other.rows
        self.matched += other.matched
        self.problems += other.problems


def compare(
    got: np.ndarray | None,
    expected: np.ndarray,
    moe_layers: tuple[int, ...],
    label: str = "",
) -> Match:
    """Compare ``got`` `[T, L, K]` (vLLM, any id order) with ``expected`` (reference, sorted).

    MoE-layer rows must hold the same id set; dense-layer rows must be all zero.
    """
    result = Match()
    if got is None:
        result.problems.append(f"{label}: routed_experts is None")
        return result
    if got.shape != expected.shape:
        result.problems.append(f"{label}: shape {got.shape} != expected {expected.shape}")
        return result
    dense = [layer for layer in range(expected.shape[1]) if layer not in moe_layers]
    if dense and np.any(got[:, dense] != 0):
        result.problems.append(f"{label}: dense layers {dense} hold non-zero ids")
    got_sorted = np.sort(got[:, list(moe_layers)].astype(np.int64), axis=-1)
    same = np.all(got_sorted == expected[:, list(moe_layers)], axis=-1)  # [T, num_moe_layers]
    result.rows = int(same.size)
    result.matched = int(same.sum())
    if result.matched != result.rows:
        token, layer = np.argwhere(~same)[0]
        result.problems.append(
            f"{label}: {result.rows - result.matched}/{result.rows} rows differ; first at token "
            f"{token}, layer {moe_layers[layer]}: got {got_sorted[token, layer].tolist()}, "
            f"expected {expected[token, moe_layers[layer]].tolist()}"
        )
    return result
