# SPDX-License-Identifier: Apache-2.0
"""record_topk_ids (reference backend) against an independent NumPy oracle; compile and opcheck."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_ascend_routing.ops import record_topk_ids

POISON = 77


def oracle(ids: np.ndarray, out: np.ndarray, layer: int, rows: np.ndarray | None, num_experts: int | None,
           invalid: int, limit: int) -> tuple[np.ndarray, int]:
    out = out.copy()
    bad_count = 0
    for i in range(ids.shape[0]):
        row = i if rows is None else int(rows[i])  # negative: padding, skipped (ids still counted)
        values = []
        for v in ids[i]:
            if num_experts is not None and not 0 <= v < min(num_experts, limit):
                bad_count += 1
                values.append(invalid)
            else:
                values.append(v)
        if row >= 0:
            out[row, layer] = np.array(values).astype(out.dtype)
    return out, bad_count


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 300])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.int16, torch.uint8])
def test_matches_oracle(num_tokens: int, top_k: int, id_dtype: torch.dtype, with_rows: bool,
                        out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 131 + top_k)
    num_experts = 200 if out_dtype == torch.uint8 else 300
    num_rows, num_layers, layer = num_tokens + 5, 6, 3
    # ids include out-of-range values on both sides
    ids = torch.randint(-2, num_experts + 3, (num_tokens, top_k), generator=gen, dtype=id_dtype)
    out = torch.full((num_rows, num_layers, top_k), POISON, dtype=out_dtype)
    rows = None
    if with_rows:
        rows = torch.randperm(num_rows, generator=gen)[:num_tokens].to(torch.int64)
        rows[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    errors = torch.zeros(1, dtype=torch.int64)
    expected, bad = oracle(ids.numpy(), out.numpy(), layer, None if rows is None else rows.numpy(), num_experts,
                           -1 if out_dtype == torch.int16 else 255, 32767 if out_dtype == torch.int16 else 255)
    record_topk_ids(ids, out, layer, rows, num_experts, errors)
    np.testing.assert_array_equal(out.numpy(), expected)
    assert int(errors) == bad
    untouched = [i for i in range(num_layers) if i != layer]
    assert (out[:, untouched] == POISON).all()


def test_without_num_experts_values_are_cast() -> None:
    out = torch.zeros(2, 1, 2, dtype=torch.int16)
    record_topk_ids(torch.tensor([[3, 9], [0, 1]], dtype=torch.int32), out, 0)
    assert out[:, 0].tolist() == [[3, 9], [0, 1]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer_id": 4}, "layer_id 4"),
        ({"ids": torch.zeros(9, 2, dtype=torch.int32)}, "do not fit"),
        ({"ids": torch.zeros(2, 3, dtype=torch.int32)}, "top_k mismatch"),
        ({"ids": torch.zeros(2, 2)}, "int32 or int64"),
        ({"out": torch.zeros(8, 4, 2, dtype=torch.int32)}, "int16 or uint8"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, message: str) -> None:
    ids = kwargs.get("ids", torch.zeros(2, 2, dtype=torch.int32))
    out = kwargs.get("out", torch.zeros(8, 4, 2, dtype=torch.int16))
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        record_topk_ids(ids, out, kwargs.get("layer_id", 0))


def test_write_survives_torch_compile_fullgraph() -> None:
    """The reason the op exists: a compiled callback must keep the write into a captured buffer."""
    buffer = torch.zeros(16, 3, 2, dtype=torch.int16)

    def layer_forward(x: torch.Tensor) -> torch.Tensor:
        ids = torch.topk(x, 2, dim=-1).indices.to(torch.int32)
        record_topk_ids(ids, buffer, 1, None, x.shape[-1])
        return x * 2

    compiled = torch.compile(layer_forward, fullgraph=True)
    x = torch.randn(5, 8)
    expected = torch.topk(x, 2, dim=-1).indices
    y = compiled(x)
    torch.testing.assert_close(y, x * 2)
    assert buffer[:5, 1].tolist() == expected.tolist()
    assert (buffer[:, [0, 2]] == 0).all() and (buffer[5:] == 0).all()
    x2 = torch.randn(5, 8)  # a second call with new data updates the buffer again
    compiled(x2)
    assert buffer[:5, 1].tolist() == torch.topk(x2, 2, dim=-1).indices.tolist()


def test_opcheck() -> None:
    op = torch.ops.vllm_ascend_routing.record_topk_ids.default
    ids = torch.randint(0, 8, (6, 2), dtype=torch.int32)
    rows = torch.tensor([5, 0, -1, 2, 3, -1])
    for args in [
        (ids, torch.zeros(8, 3, 2, dtype=torch.int16), 2, None, 8, torch.zeros(1, dtype=torch.int32)),
        (ids, torch.zeros(8, 3, 2, dtype=torch.uint8), 0, rows, None, torch.zeros(1, dtype=torch.int64)),
    ]:
        torch.library.opcheck(op, args)
