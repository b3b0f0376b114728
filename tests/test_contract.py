# SPDX-License-Identifier: Apache-2.0
"""``contract.request_rows``: a request's rows from token 0 on the decoder-layer axis, the prompt's rows joined where
the release returns them apart (the release table's ``prompt_rows_field``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from vllm_ascend_routing import contract, releases

CONFIG = SimpleNamespace(num_hidden_layers=3, decoder_sparse_step=1, mlp_only_layers=[1], num_experts=8)


def output(routed: np.ndarray | None, **fields: object) -> SimpleNamespace:
    return SimpleNamespace(outputs=[SimpleNamespace(routed_experts=routed)], **fields)


def test_one_array_is_returned_as_it_is() -> None:
    routed = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
    plain = output(routed)
    assert contract.prompt_rows_apart(plain) is None
    assert contract.request_rows(plain, CONFIG) is routed


def test_the_prompt_rows_apart_are_joined_and_widened() -> None:
    (field,) = releases.prompt_rows_fields()
    prompt, generated = np.full((3, 2, 2), 1, np.int16), np.full((2, 2, 2), 2, np.int16)
    split = output(generated, **{field: prompt})
    assert contract.prompt_rows_apart(split) == (prompt, generated)
    rows = contract.request_rows(split, CONFIG)
    assert rows is not None and rows.dtype == np.int32 and rows.shape == (5, 3, 2)
    assert (rows[:3, [0, 2]] == 1).all() and (rows[3:, [0, 2]] == 2).all() and not rows[:, 1].any()
    assert contract.request_rows(output(None, **{field: None}), CONFIG) is None
