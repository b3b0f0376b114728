# SPDX-License-Identifier: Apache-2.0
"""NeMo RL's form of one sample's rows (:func:`for_nemo_rl`). NumPy only, never vLLM."""

from __future__ import annotations

import numpy as np

from vllm_ascend_routing.replay.aligned import INVALID, Aligned


def for_nemo_rl(aligned: Aligned | tuple[np.ndarray, np.ndarray], num_experts: int) -> np.ndarray:
    """One sample in NeMo RL's form: `[T-1, num_layers, top_k]`, row ``t`` = token ``t``, ``-1`` (its missing-route
    sentinel: route natively) in rows without recorded routing, in its carry dtype for ``num_experts`` (the
    narrowest signed integer holding ``num_experts - 1``: int8, int16, int32).

    NeMo RL reads vLLM's array from token 0; with ``routed_experts_prompt_start > 0`` it would take row 0 for
    token 0. This puts the rows at their tokens and the prompt rows before ``prompt_start`` on native routing.
    A signed dtype also spares NeMo RL's conversion the uint16 arrays (more than 256 experts) it fails on.
    """
    dtype = next(d for d in (np.int8, np.int16, np.int32) if num_experts - 1 <= np.iinfo(d).max)
    if isinstance(aligned, Aligned):  # written in the carry dtype directly, never widened to int64
        out = np.full((aligned.num_tokens - 1, *aligned.parts[0].shape[1:]), INVALID, dtype=dtype)
        token = aligned.first
        for part in aligned.parts:
            part = part[: max(0, aligned.num_tokens - 1 - token)]  # the last token has no row in NeMo RL's form
            if part.size and (part.max() >= num_experts or part.min() < 0):
                raise ValueError(f"an expert id outside [0, {num_experts}) in the recorded rows")
            out[token : token + len(part)] = part
            token += len(part)
        return out
    routes, valid = np.asarray(aligned[0]), np.asarray(aligned[1], dtype=bool)
    rows = routes[:-1].copy()
    rows[~valid[:-1]] = INVALID
    if rows.size and (rows.max() >= num_experts or rows[valid[:-1]].min(initial=0) < 0):
        raise ValueError(f"an expert id outside [0, {num_experts}) in the recorded rows")
    return rows.astype(dtype)
