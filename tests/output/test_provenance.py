# SPDX-License-Identifier: Apache-2.0
"""The provenance record beside each array: counts that add up, the contract read off the array, straddling."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_ascend_routing.output import provenance


def engine_part(first: int = 0, cached: int = 0, loaded: int = 0, versions: tuple = (1, 1, None)) -> dict:
    return {
        "first_token": first,
        "cached": cached,
        "loaded": loaded,
        "weight_version": dict(zip(("first", "last", "cached_from"), versions, strict=True)),
    }


def test_counts_add_up_to_the_rows_and_the_contract_is_the_arrays() -> None:
    routed = np.zeros((40, 5, 8), dtype=np.uint8)
    record = provenance.complete(engine_part(3, cached=29, loaded=4), routed, "runner-output", "0.30.0")
    assert record["rows"] == 40 and (record["computed"], record["cached"], record["loaded"]) == (7, 29, 4)
    assert record["first_token"] == 3
    assert (record["dtype"], record["num_layers"], record["top_k"]) == ("uint8", 5, 8)
    assert (record["layer_axis"], record["generation"], record["vllm"]) == ("hidden_layers", "runner-output", "0.30.0")
    assert record["straddles"] is False


def test_counts_never_exceed_the_rows_returned() -> None:
    routed = np.zeros((10, 2, 2), dtype=np.uint16)  # fewer rows than the engine counted (e.g. a stop string)
    record = provenance.complete(engine_part(cached=12, loaded=3), routed, "aux-output", "0.32.0")
    assert (record["computed"], record["cached"], record["loaded"]) == (0, 10, 0) and record["dtype"] == "uint16"


@pytest.mark.parametrize(
    ("versions", "straddles"),
    [
        ((1, 1, None), False),
        ((1, 2, None), True),  # a weight update between the request's first forward and its last row
        ((2, 2, 1), True),  # cached rows may predate the update (no prefix-cache reset since)
        ((2, 2, 2), False),  # cached after the reset that followed the update
        ((None, 1, None), None),  # a step whose version did not reach the scheduler: unknown, never "no"
        ((1, None, None), None),
    ],
)
def test_straddles(versions: tuple, straddles: bool | None) -> None:
    assert provenance.straddles(dict(zip(("first", "last", "cached_from"), versions, strict=True))) is straddles
