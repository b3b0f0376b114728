# SPDX-License-Identifier: Apache-2.0
import numpy as np
import pytest

from vllm_ascend_routing.preflight.compare import TIE_EPS, compare


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


def test_low_precision_engines_get_their_dtypes_rounding_and_no_more() -> None:
    """Planted near-ties against the float32 reference: a bfloat16 engine may flip a boundary gap of a few
    bfloat16 roundoffs (counted), a float32 engine may not, and no dtype excuses a gap beyond its rule."""
    from vllm_ascend_routing.preflight.compare import ROUNDOFF, TIE_ULPS, tie_tolerance

    ref = reference()
    bf16_gap = 4 * ROUNDOFF["bfloat16"]  # 0.0156: four bfloat16 roundoffs below the chosen expert's logit 1.0
    logits = logits_for(ref)
    logits[1, 2, 5] = 1.0 - bf16_gap
    got = ref.astype(np.uint8)
    got[1, 2] = [1, 5]
    bf16 = compare(got, ref, (0, 2), logits=logits, dtype="bfloat16")
    assert bf16.ok and bf16.ties == 1
    assert not compare(got, ref, (0, 2), logits=logits, dtype="float32").ok  # 1.56e-2 is no float32 rounding
    assert compare(got, ref, (0, 2), logits=logits, dtype="float16").ok == (bf16_gap <= tie_tolerance("float16", 1))
    # Just beyond the bfloat16 rule: a real difference.
    logits[1, 2, 5] = 1.0 - 1.01 * TIE_ULPS * ROUNDOFF["bfloat16"]
    assert not compare(got, ref, (0, 2), logits=logits, dtype="bfloat16").ok
    # The rule scales with the boundary logit's size (relative rounding), never below float32's.
    assert tie_tolerance("bfloat16", 8.0) == 8 * tie_tolerance("bfloat16", 1.0)
    assert tie_tolerance("float32", 0.0) == TIE_EPS
    with pytest.raises(ValueError, match="no near-tie rule"):
        tie_tolerance("int8", 1.0)


def test_a_zero_row_is_never_a_near_tie_whatever_the_dtype() -> None:
    """A zero (or padded) row repeats one id: with the chosen experts' logits packed close together it could
    otherwise pass a loose low-precision rule."""
    ref = reference()
    logits = logits_for(ref)
    logits[:, :, :] = 1.0  # every expert within any tolerance of the boundary
    got = ref.astype(np.uint8)
    got[1, 2] = [0, 0]
    for dtype in ("float32", "bfloat16", "float16"):
        assert not compare(got, ref, (0, 2), logits=logits, dtype=dtype).ok
