# SPDX-License-Identifier: Apache-2.0
import numpy as np

from vllm_ascend_routing.testing.compare import compare


def reference() -> np.ndarray:
    ref = np.zeros((3, 3, 2), dtype=np.int64)
    ref[:, 0] = [[1, 4], [0, 2], [3, 5]]
    ref[:, 2] = [[2, 7], [1, 6], [0, 4]]
    return ref


def test_exact_match_in_any_order() -> None:
    got = reference()[:, :, ::-1].astype(np.uint8)
    result = compare(got, reference(), (0, 2))
    assert result.ok and result.rows == 6 and result.rate == 1.0


def test_one_wrong_row_is_reported() -> None:
    got = reference().astype(np.uint8)
    got[1, 2] = [1, 5]
    result = compare(got, reference(), (0, 2), label="r")
    assert not result.ok and result.matched == 5
    assert "first at token 1, layer 2" in result.problems[0]


def test_zeros_fail() -> None:
    assert not compare(np.zeros((3, 3, 2), np.uint8), reference(), (0, 2)).ok


def test_dense_layer_must_be_zero() -> None:
    got = reference().astype(np.uint8)
    got[0, 1] = [1, 1]
    result = compare(got, reference(), (0, 2))
    assert not result.ok and "dense layers [1]" in result.problems[0]


def test_shape_and_none() -> None:
    assert not compare(reference()[:2], reference(), (0, 2)).ok
    assert not compare(None, reference(), (0, 2)).ok


def logits_for(ref: np.ndarray, num_experts: int = 8) -> np.ndarray:
    """Router logits consistent with ``ref``: chosen experts well above the rest."""
    logits = np.zeros((ref.shape[0], ref.shape[1], num_experts), dtype=np.float32)
    for t in range(ref.shape[0]):
        for layer in (0, 2):
            logits[t, layer, ref[t, layer]] = [2.0, 1.0]
    return logits


def test_float32_near_tie_is_counted_not_hidden() -> None:
    ref, got = reference(), reference().astype(np.uint8)
    logits = logits_for(ref)
    logits[1, 2, 5] = 1.0 - 5e-7  # expert 5 ties with chosen expert 6 (logit 1.0) within float32 noise
    got[1, 2] = [1, 5]
    result = compare(got, ref, (0, 2), logits=logits)
    assert result.ok and result.ties == 1 and result.matched == 6


def test_a_real_difference_is_not_a_tie() -> None:
    ref, got = reference(), reference().astype(np.uint8)
    logits = logits_for(ref)  # expert 5 far below the boundary
    got[1, 2] = [1, 5]
    result = compare(got, ref, (0, 2), logits=logits)
    assert not result.ok and result.ties == 0
    assert not compare(np.zeros((3, 3, 2), np.uint8), ref, (0, 2), logits=logits).ok  # zeros stay zeros


def test_later_layers_of_a_tied_token_follow_the_tie_only() -> None:
    ref, got = reference(), reference().astype(np.uint8)
    logits = logits_for(ref)
    logits[1, 0, 3] = 1.0 - 5e-7  # token 1, layer 0: expert 3 ties with chosen expert 2
    got[1, 0] = [0, 3]
    got[1, 2] = [1, 7]  # token 1, layer 2 diverges after the flip: accepted as its consequence
    result = compare(got, ref, (0, 2), logits=logits)
    assert result.ok and result.ties == 2
    got[2, 2] = [0, 7]  # another token's later layer: not covered
    assert not compare(got, ref, (0, 2), logits=logits).ok
