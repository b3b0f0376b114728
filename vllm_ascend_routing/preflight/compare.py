# SPDX-License-Identifier: Apache-2.0
"""Exact comparison of vLLM's returned routed experts with the reference, per (token, MoE layer) row.

One principled allowance: a near-tie. Where the reference's router logits of two experts at the top-k
boundary differ by less than the engine dtype's rounding (``tie_tolerance``: ``TIE_EPS``, a few float32 ulps,
when vLLM runs float32 like the reference; ``TIE_ULPS`` units of bfloat16's or float16's rounding, relative to
the boundary logit, when vLLM runs in that dtype against the float32 reference), vLLM's kernels and the
reference's forward may order them differently; such a row, and the same token's later layers (whose input then
differs by another expert's output), are counted in ``ties`` (and reported), never silently. Any other
difference (a zero row, another request's row, a shifted token, a physical id) changes experts whose logits
are far from the boundary and fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Match:
    """Row counts of one comparison; ``ok`` only when every row is identical and shapes agree."""

    rows: int = 0
    matched: int = 0  # identical rows, plus near-tie rows (counted again in ``ties``)
    ties: int = 0
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
        self.ties += other.ties
        self.problems += other.problems


TIE_EPS = 1e-5  # router-logit difference below which two experts are a float32 near-tie
# Unit roundoff of each engine dtype, and how many of them (relative to the boundary logit's size) a gap may be
# to count as a near-tie when vLLM computes in that dtype: every layer before the router rounds too, so a
# low-precision engine's router logits sit several roundoffs from the float32 reference's.
ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
TIE_ULPS = 16


def tie_tolerance(dtype: str, boundary: float) -> float:
    """The largest reference gap at the top-k boundary that a vLLM engine in ``dtype`` may order otherwise."""
    if dtype not in ROUNDOFF:
        raise ValueError(f"no near-tie rule for dtype {dtype!r} (known: {', '.join(ROUNDOFF)})")
    return max(TIE_EPS, TIE_ULPS * ROUNDOFF[dtype] * max(1.0, abs(boundary)))


def compare(
    got: np.ndarray | None,
    expected: np.ndarray,
    moe_layers: tuple[int, ...],
    label: str = "",
    logits: np.ndarray | None = None,
    dtype: str = "float32",
) -> Match:
    """Compare ``got`` `[T, L, K]` (vLLM, any id order) with ``expected`` (reference, sorted).

    MoE-layer rows must hold the same id set; dense-layer rows must be all zero. With the reference's
    router ``logits`` `[T, L, E]`, a differing row whose differing experts all sit within
    ``tie_tolerance(dtype, …)`` of the reference's k-th logit is a near-tie (``ties``); ``dtype``: the engine's.
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
    if logits is not None:
        tied_tokens: set[int] = set()
        for token, j in np.argwhere(~same):  # token-major, layers ascending
            if int(token) in tied_tokens or _near_tie(
                got_sorted[token, j], expected[token, moe_layers[j]], logits[token, moe_layers[j]], dtype
            ):
                # After a near-tie flip, this token's later layers see another expert's output in vLLM
                # than in the reference: the reference no longer decides them.
                same[token, j] = True
                result.ties += 1
                tied_tokens.add(int(token))
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


def _near_tie(got: np.ndarray, expected: np.ndarray, logits: np.ndarray, dtype: str) -> bool:
    """``got`` holds ``k`` distinct ids (a zero or padded row repeats one: never a tie), and every id in one row
    but not the other has a reference logit within the dtype's tolerance of the reference's k-th logit."""
    if len(np.unique(got)) != len(got):
        return False
    boundary = float(np.min(logits[expected]))  # the reference's k-th largest logit
    differing = np.setxor1d(got, expected)
    if np.any((differing < 0) | (differing >= logits.shape[0])):
        return False
    return bool(np.all(np.abs(logits[differing] - boundary) <= tie_tolerance(dtype, boundary)))
