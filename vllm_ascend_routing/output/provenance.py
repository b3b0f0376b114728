# SPDX-License-Identifier: Apache-2.0
"""The provenance record that travels beside each returned array: ``CompletionOutput.routed_experts_info`` (and,
over HTTP, ``routed_experts_info`` next to ``routed_experts`` in each choice).

    {"first_token": 0, "rows": 311, "computed": 119, "cached": 192, "loaded": 0,
     "dtype": "uint8", "num_layers": 3, "top_k": 4, "layer_axis": "hidden_layers", "ids": "logical",
     "generation": "runner-output", "vllm": "0.30.0",
     "weight_version": {"first": 1, "last": 2, "cached_from": 1}, "straddles": true}

Row ``i`` of the array is token ``first_token + i``; ``computed + cached + loaded == rows``: rows this engine's
forward computed for the request, rows served from its prefix cache (computed by an earlier request), rows loaded
through a KV connector (P/D hand-over: ``kv.loaded_span``). ``weight_version``: how many times the model's
weights had been loaded or updated (``output.weights``) when the request's first forward and the forward of its
last row ran; rows served from the prefix cache were computed at ``cached_from`` or later (``null`` without
cached rows). ``straddles``: the rows may come from more than one weight version (``null``: a version is unknown).
On a store engine (``VLLM_ASCEND_ROUTING_STORE``) the array stays in the store: ``routed_experts`` is ``None`` and
``store_key`` names it (``replay.fetch(key)`` returns exactly this array); where the store refused it (full,
unreachable), the array is inline and ``store_fallback`` says why.
"""

from __future__ import annotations

from typing import Any

import numpy as np

STORE_KEY = "store_key"  # where the rows are, on a store engine (VLLM_ASCEND_ROUTING_STORE)
FALLBACK = "store_fallback"  # why a store engine returned a request's rows inline
VIOLATIONS = "store_violations"  # validation mode found the rows broken: not stored (store/publisher.py)
LAYER_AXIS = "hidden_layers"  # 0.22+: one column per decoder layer, dense layers all zero


def complete(engine_part: dict[str, Any], routed: np.ndarray | None, generation: str, vllm: str) -> dict[str, Any]:
    """The record of one returned array, from the engine core's part (``output.engine.engine_record``); on a store
    engine (``routed`` ``None``) of the stored array, with its key (``store_key``: ``replay.fetch`` returns the
    array), or why the rows came inline instead (``store_fallback``)."""
    key = engine_part.get(STORE_KEY)
    if routed is None:
        shape, dtype = tuple(engine_part["shape"]), str(engine_part["dtype"])
    else:
        shape, dtype = tuple(routed.shape), str(routed.dtype)
    rows = int(shape[0])
    cached = min(int(engine_part.get("cached", 0)), rows)
    loaded = min(int(engine_part.get("loaded", 0)), rows - cached)
    versions = dict(engine_part.get("weight_version") or {})
    record = {
        "first_token": int(engine_part["first_token"]),
        "rows": rows,
        "computed": rows - cached - loaded,
        "cached": cached,
        "loaded": loaded,
        "dtype": dtype,
        "num_layers": int(shape[1]) if len(shape) == 3 else None,
        "top_k": int(shape[2]) if len(shape) == 3 else None,
        "layer_axis": LAYER_AXIS,
        "ids": "logical",
        "generation": generation,
        "vllm": vllm,
        "weight_version": versions,
        "straddles": straddles(versions),
    }
    if key is not None:
        record[STORE_KEY] = key
    for extra in (FALLBACK, VIOLATIONS):  # why the rows came inline; what validation mode found (logged there)
        if extra in engine_part:
            record[extra] = engine_part[extra]
    return record


def straddles(versions: dict[str, Any]) -> bool | None:
    """Whether rows of the request may come from more than one weight version (``None``: a version is unknown)."""
    first, last, cached_from = versions.get("first"), versions.get("last"), versions.get("cached_from")
    if first is None or last is None:
        return None
    return first != last or (cached_from is not None and cached_from != first)
