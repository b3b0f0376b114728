# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY faults planted in routed-experts arrays, for the re-prefill consistency oracle's tests: each is the
shape a real capture or output-path bug gives (never used by the plugin).

Every function takes the true rows of each request (``[rows, layers, top_k]``, row ``i`` = token ``i``) and each
request's prompt length, and returns the rows a broken path would have returned.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Rows = list[np.ndarray]


def decode_late(rows: Rows, prompts: list[int]) -> Rows:
    """Decode rows one token late: row ``i`` (a decode token) holds token ``i - 1``'s routing."""
    out = [r.copy() for r in rows]
    for r, (array, prompt) in enumerate(zip(rows, prompts, strict=True)):
        out[r][prompt:] = array[prompt - 1 : -1]
    return out


def swap_requests(rows: Rows, prompts: list[int]) -> Rows:
    """The first two requests of the same row count have each other's rows."""
    out = [r.copy() for r in rows]
    for a in range(len(rows)):
        for b in range(a + 1, len(rows)):
            if rows[a].shape == rows[b].shape:
                out[a], out[b] = rows[b].copy(), rows[a].copy()
                return out
    raise ValueError("swap_requests needs two requests with the same row count")


def stale_step(rows: Rows, prompts: list[int]) -> Rows:
    """Each decode step returns the previous step's buffer (same flat index): one prefill step of every prompt,
    then decode steps of the requests still running, in order, one token each (batch composition changes as
    requests finish)."""
    out = [r.copy() for r in rows]
    previous = np.concatenate([array[:prompt] for array, prompt in zip(rows, prompts, strict=True)])  # the prefill step
    position = list(prompts)
    while True:
        running = [r for r in range(len(rows)) if position[r] < len(rows[r])]
        if not running:
            return out
        step = np.stack([rows[r][position[r]] for r in running])
        for slot, r in enumerate(running):
            out[r][position[r]] = previous[slot] if slot < len(previous) else 0
            position[r] += 1
        previous = step


def layer_zero(rows: Rows, prompts: list[int]) -> Rows:
    """The last MoE layer's rows all zero (its capture never ran)."""
    out = [r.copy() for r in rows]
    layer = max(layer for layer in range(rows[0].shape[1]) if any(array[:, layer].any() for array in rows))
    for array in out:
        array[:, layer] = 0
    return out


def half_tokens_zero(rows: Rows, prompts: list[int]) -> Rows:
    """Every other token's rows zero in every layer: one of two TP ranks' share of a token-split step missing."""
    out = [r.copy() for r in rows]
    for array in out:
        array[1::2] = 0
    return out


def dp_interleave(rows: Rows, prompts: list[int]) -> Rows:
    """Requests paired as two DP ranks' (0/1, 2/3, ... of the same row count): odd rows come from the partner."""
    out = [r.copy() for r in rows]
    for a in range(0, len(rows) - 1, 2):
        b = a + 1
        if rows[a].shape == rows[b].shape:
            out[a][1::2], out[b][1::2] = rows[b][1::2], rows[a][1::2]
    return out


# name -> (mutation, the fault the oracle must name)
MUTATIONS: dict[str, tuple[Callable[[Rows, list[int]], Rows], str]] = {
    "decode_late": (decode_late, "SHIFTED_LATE"),
    "swap_requests": (swap_requests, "OTHER_REQUEST"),
    "stale_step": (stale_step, "STALE_STEP"),
    "layer_zero": (layer_zero, "LAYER_ZERO"),
    "half_tokens_zero": (half_tokens_zero, "PARTIAL"),
    "dp_interleave": (dp_interleave, "DP_INTERLEAVE"),
}
