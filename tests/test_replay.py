# SPDX-License-Identifier: Apache-2.0
"""The replay bridge: every generation's array on the token axis, MoE layers from configs, Megatron packing."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import vllm_ascend_routing
from vllm_ascend_routing import replay
from vllm_ascend_routing.replay import UnknownMoELayersError, align, check, moe_layers, to_megatron
from vllm_ascend_routing.replay.aligned import INVALID


def vllm_rows(
    rows: int,
    num_layers: int,
    top_k: int,
    num_experts: int,
    dense: tuple[int, ...] = (),
    *,
    dtype: type = np.uint8,
    seed: int = 0,
) -> np.ndarray:
    """What vLLM returns: distinct ids per MoE row, zero dense rows, in the generation's dtype."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((rows, num_layers, num_experts)), axis=-1)[..., :top_k]
    ids[:, list(dense)] = 0
    return ids.astype(dtype)


# ---- align ----


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
@pytest.mark.parametrize("prompt_start", [0, 3])
def test_align_0_22_rows_start_at_prompt_start(dtype: type, prompt_start: int) -> None:
    prompt_len, output_len = 6, 4  # T = 10: rows for tokens prompt_start..8, token 9 never forwarded
    routed = vllm_rows(10 - 1 - prompt_start, 3, 2, 8, dense=(1,), dtype=dtype)
    aligned = align(routed, prompt_len, output_len, prompt_start)
    assert aligned.parts[0] is routed  # vLLM's array itself: no copy, its dtype
    routes, valid = aligned.routes, aligned.valid
    assert routes.shape == (10, 3, 2) and routes.dtype == np.int64 and valid.dtype == bool
    assert valid.tolist() == [t >= prompt_start for t in range(9)] + [False]
    np.testing.assert_array_equal(routes[prompt_start:9], routed.astype(np.int64))
    assert (routes[~valid] == INVALID).all()


def test_align_0_20_int32_has_every_row_but_the_last() -> None:
    routed = vllm_rows(9, 2, 2, 8, dtype=np.int32)
    aligned = align(routed, 6, 4)
    routes, valid = aligned.routes, aligned.valid
    assert valid.tolist() == [True] * 9 + [False]
    np.testing.assert_array_equal(routes[:9], routed)


def test_align_refuses_other_row_counts_naming_the_expected_one() -> None:
    with pytest.raises(ValueError, match=r"uint8/uint16 with T-1-prompt_start = 7 rows"):
        align(vllm_rows(9, 2, 2, 8), 6, 4, prompt_start=2)  # 0.22+ array, prompt_start forgotten upstream
    with pytest.raises(ValueError, match=r"int32 with T-1 = 9 rows"):
        align(vllm_rows(10, 2, 2, 8, dtype=np.int32), 6, 4)  # a row for the last token: not vLLM's
    with pytest.raises(ValueError, match=r"no prompt_start.*T-1 = 9 rows"):
        align(vllm_rows(9, 2, 2, 8, dtype=np.int32), 6, 4, prompt_start=2)


def test_align_refuses_converted_arrays() -> None:
    """The dtype tells the generation, hence the row count: a widened array cannot be placed safely."""
    with pytest.raises(ValueError, match=r"dtype int64.*T-1 = 9 rows.*T-1-prompt_start = 9 rows"):
        align(vllm_rows(9, 2, 2, 8).astype(np.int64), 6, 4)
    with pytest.raises(ValueError, match=r"shape \(9, 2\)"):
        align(np.zeros((9, 2), np.uint8), 6, 4)
    with pytest.raises(ValueError, match="prompt_start=10"):
        align(vllm_rows(9, 2, 2, 8), 6, 4, prompt_start=10)


# ---- moe_layers ----


def test_moe_layers_of_each_family() -> None:
    import transformers as tf

    assert moe_layers(tf.Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[1])) == (0, 2, 3)
    assert moe_layers(tf.Qwen2MoeConfig(num_hidden_layers=6, decoder_sparse_step=2)) == (1, 3, 5)
    assert moe_layers(tf.DeepseekV3Config(num_hidden_layers=6, first_k_dense_replace=3)) == (3, 4, 5)
    assert moe_layers(tf.DeepseekV2Config(num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2)) == (2, 4)
    assert moe_layers(tf.Glm4MoeConfig(num_hidden_layers=4, first_k_dense_replace=1)) == (1, 2, 3)
    assert moe_layers(tf.MixtralConfig(num_hidden_layers=3)) == (0, 1, 2)
    assert moe_layers(tf.OlmoeConfig(num_hidden_layers=3)) == (0, 1, 2)
    # A multimodal config is read through its text config; num_layers overrides the config's.
    assert moe_layers(SimpleNamespace(text_config=tf.Qwen3MoeConfig(num_hidden_layers=2))) == (0, 1)
    assert moe_layers(SimpleNamespace(first_k_dense_replace=1), num_layers=3) == (1, 2)


def test_moe_layers_refuses_a_config_it_cannot_read() -> None:
    import transformers as tf

    with pytest.raises(UnknownMoELayersError, match=r"model_type 'llama'.*Qwen2/3-MoE.*DeepSeek.*Mixtral.*OLMoE"):
        moe_layers(tf.LlamaConfig())
    with pytest.raises(ValueError, match="no num_hidden_layers"):
        moe_layers(SimpleNamespace(num_local_experts=8))


# ---- check ----


def test_check_rules_on_vllm_rows_and_on_aligned_routes() -> None:
    routed = vllm_rows(9, 3, 2, 8, dense=(1,))
    assert check(routed, 8, (0, 2)) == []
    aligned = align(routed, 6, 4)
    routes, valid = aligned.routes, aligned.valid
    assert check(routes, 8, (0, 2), valid=valid) == []  # the INVALID last row is not a recorded row
    assert [v.what for v in check(routes, 8, (0, 2))][:1] == ["non-zero ids in a dense layer"]
    bad = routed.copy()
    bad[4, 2] = [5, 5]
    bad[6, 1, 0] = 3
    found = [(v.what, v.layer, v.row) for v in check(bad, 8, (0, 2), expected_rows=8)]
    assert found == [
        ("9 rows, expected 8", None, None),
        ("non-zero ids in a dense layer", 1, 6),
        ("the same expert twice in one row", 2, 4),
    ]
    assert [(v.what, v.layer) for v in check(routed, 6, (0, 2))][0] == ("id outside [0, 6)", 0)
    zeros = routed.copy()
    zeros[:, 2] = 0  # a router the capture missed
    assert ("MoE layer all zero across the request", 2, None) in [
        (v.what, v.layer, v.row) for v in check(zeros, 8, (0, 2))
    ]


def test_check_more_than_256_experts() -> None:
    routed = vllm_rows(5, 2, 8, 300, dtype=np.uint16)
    assert routed.max() > 255 and check(routed, 300, (0, 1)) == []
    assert [v.what for v in check(routed, 256, (0, 1))][0] == "id outside [0, 256)"


# ---- to_megatron ----


def test_to_megatron_packs_moe_layers_pads_with_distinct_ids() -> None:
    num_experts, top_k = 8, 2
    a = align(vllm_rows(9, 3, top_k, num_experts, dense=(1,), seed=1), 6, 4)  # T = 10
    b = align(vllm_rows(4, 3, top_k, num_experts, dense=(1,), seed=2), 4, 3, prompt_start=2)  # T = 7
    replay_data = to_megatron([a, b], (2, 0), num_experts, pad_to=4)  # order given is not the layer order
    assert len(replay_data.indices) == 2  # dense layer 1 dropped
    for j, layer in enumerate((0, 2)):
        tensor = replay_data.indices[j]
        assert tensor.dtype == torch.int64 and tensor.shape == (12 + 8, top_k)
        np.testing.assert_array_equal(tensor[:10][a.valid].numpy(), a.routes[a.valid, layer])
        np.testing.assert_array_equal(tensor[12:19][b.valid].numpy(), b.routes[b.valid, layer])
    valid = replay_data.valid.numpy()
    assert valid.tolist() == a.valid.tolist() + [False] * 2 + b.valid.tolist() + [False]
    for tensor in replay_data.indices:  # every row, filler included, is top_k distinct experts
        rows = np.sort(tensor.numpy(), axis=1)
        assert ((rows[:, 1:] != rows[:, :-1]).all()) and rows.min() >= 0 and rows.max() < num_experts
        assert len({tuple(r) for r in tensor[~replay_data.valid].tolist()}) > 1  # spread, not one expert pair


def test_to_megatron_more_than_256_experts_and_int32_rows() -> None:
    num_experts, top_k = 300, 8
    wide = align(vllm_rows(20, 2, top_k, num_experts, dtype=np.uint16), 12, 9)
    old = align(vllm_rows(20, 2, top_k, num_experts, dtype=np.int32, seed=3), 12, 9)
    replay_data = to_megatron([wide, old], (0, 1), num_experts)
    assert [t.shape for t in replay_data.indices] == [(42, top_k)] * 2
    assert int(replay_data.indices[1].max()) > 255
    np.testing.assert_array_equal(replay_data.indices[1][21:41].numpy(), old.routes[:20, 1])


@pytest.mark.parametrize(
    ("num_experts", "vllm_dtype", "narrow"),
    [
        (8, np.uint8, torch.uint8),
        (256, np.int32, torch.uint8),
        (300, np.uint16, torch.int16),
        (40000, np.int32, torch.int32),
    ],
)
def test_to_megatron_stays_narrow_and_widens_per_layer(num_experts: int, vllm_dtype: type, narrow: torch.dtype) -> None:
    """The block keeps a narrow dtype (dense layers never copied); one layer at a time becomes int64."""
    routed = vllm_rows(9, 3, 2, num_experts, dense=(1,), dtype=vllm_dtype)
    data = to_megatron([align(routed, 6, 4)], (0, 2), num_experts, pad_to=4)
    assert data.ids.dtype == narrow and tuple(data.ids.shape) == (2, 12, 2)  # [MoE layers, N, top_k]
    wide = data.layer(1, torch.device("cpu"))
    assert wide.dtype == torch.int64
    np.testing.assert_array_equal(wide[:9].numpy(), routed[:, 2].astype(np.int64))


def test_to_megatron_refuses_broken_rows() -> None:
    routed = vllm_rows(9, 3, 2, 8, dense=(1,))
    with pytest.raises(ValueError, match="sample 0 .*layer 1 row 0: the same expert twice"):
        to_megatron([align(routed, 6, 4)], (0, 1), 8)  # the dense layer taken for a MoE layer
    with pytest.raises(ValueError, match="id outside"):
        to_megatron([align(routed, 6, 4)], (0, 2), 4)
    with pytest.raises(ValueError, match="top_k 2 > num_experts 1"):
        to_megatron([align(routed, 6, 4)], (0, 2), 1)
    with pytest.raises(ValueError, match="MoE layers"):
        to_megatron([align(routed, 6, 4)], (0, 3), 8)
    with pytest.raises(ValueError, match="sample 1"):
        to_megatron([align(routed, 6, 4), align(vllm_rows(9, 3, 4, 8, dense=(1,)), 6, 4)], (0, 2), 8)


def test_shard_materialises_only_the_ranks_rows_and_layers() -> None:
    """A rank's shard is its slice of the whole (Megatron's own split: tests/test_replay_megatron_shards.py); bad
    layouts are refused naming the padding Megatron needs."""
    samples = [align(vllm_rows(11 - 1, 4, 2, 8, dense=(1,), seed=s), 6, 5) for s in range(4)]  # T = 11, padded 12
    whole = to_megatron(samples, (0, 2, 3), 8, pad_to=4)
    part = to_megatron(samples, (0, 2, 3), 8, pad_to=4, shard=replay.Shard(dp_rank=1, dp_size=2, layers=(2, 3, 4)))
    assert part.layers == (2, 3) and tuple(part.ids.shape) == (2, 24, 2)  # samples 2 and 3, MoE layers 2 and 3
    half = to_megatron(samples[2:], (0, 2, 3), 8, pad_to=4)
    assert torch.equal(part.ids, half.ids[1:]) and torch.equal(part.valid, half.valid)
    cp = to_megatron(samples, (0, 2, 3), 8, pad_to=4, shard=replay.Shard(cp_rank=1, cp_size=2))
    assert torch.equal(cp.ids[:, :6], torch.cat([whole.ids[:, 3:6], whole.ids[:, 6:9]], 1))  # chunks 1 and 2 of 4
    with pytest.raises(ValueError, match=r"12 tokens \(padded\) do not split over cp_size=4.*multiple of 8"):
        to_megatron(samples, (0, 2), 8, pad_to=4, shard=replay.Shard(cp_size=4))
    with pytest.raises(ValueError, match="4 samples do not split into dp_size=3"):
        to_megatron(samples, (0, 2), 8, shard=replay.Shard(dp_size=3))
    with pytest.raises(ValueError, match=r"cp_rank=2 outside \[0, cp_size=2\)"):
        to_megatron(samples, (0, 2), 8, pad_to=4, shard=replay.Shard(cp_rank=2, cp_size=2))


def test_mask_forms_for_verl_and_nemo_rl() -> None:
    """Rows without recorded routing (before prompt_start, the last token, padding): filler ids in the full
    tensor, false in the mask (verl's replay_mask), -1 in NeMo RL's form; the recorded rows untouched."""
    a = align(vllm_rows(10 - 1 - 3, 3, 2, 8, dense=(1,), seed=4), 6, 4, prompt_start=3)  # T = 10
    data = to_megatron([a], (0, 2), 8, pad_to=4)  # N = 12
    assert data.layers == (0, 2)
    assert data.valid.tolist() == [False] * 3 + [True] * 6 + [False] * 3  # 3 before prompt_start, last, 2 padding
    for ids, native in zip(data.indices, data.native_as(), strict=True):
        assert (native[~data.valid] == -1).all() and (ids[~data.valid] >= 0).all()
        assert torch.equal(native[data.valid], ids[data.valid])
    assert (data.native_as(7)[0][~data.valid] == 7).all()


def test_check_alignment_refuses_a_shift_by_one_naming_the_convention() -> None:
    num_experts, top_k = 8, 2
    a = align(vllm_rows(19, 3, top_k, num_experts, dense=(1,), seed=5), 12, 8)
    data = to_megatron([a], (0, 2), num_experts)
    # The trainer's own routing: vLLM's on every row but a few flipped (bfloat16 disagrees on ~2% of rows).
    trainer = [ids.clone() for ids in data.indices]
    trainer[0][4] = torch.tensor([(int(trainer[0][4, 0]) + 1) % 8, int(trainer[0][4, 0])])
    assert replay.check_alignment(data, trainer) == pytest.approx(1 - 1 / (2 * 19))
    for shift in (1, -1):  # the rows a token early or late against the trainer's tokens
        shifted = replay.MegatronReplay([torch.roll(ids, shift, 0) for ids in data.indices], data.valid, data.layers)
        with pytest.raises(replay.AlignmentError, match="row t must be token t of prompt \\+ output"):
            replay.check_alignment(shifted, trainer)
    with pytest.raises(replay.AlignmentError, match="prompt_start"):  # agreeing with nothing at all
        replay.check_alignment(data, [(ids + 3) % num_experts for ids in trainer])


def test_align_row_count_mismatch_names_the_cause() -> None:
    routed = vllm_rows(10 - 1 - 3, 3, 2, 8, dense=(1,))  # returned for prompt_start = 3
    with pytest.raises(ValueError, match="prompt_start other than the request's"):
        align(routed, 6, 4)  # the trainer assumes 0, as verl and NeMo RL do


# Framework conventions, as documented facts (docs/training.md); NeMo RL and slime are not on the registry.


def nemo_rl_carry_dtype(num_experts: int) -> np.dtype:
    """NeMo RL: the narrowest signed dtype holding expert ids and its -1 sentinel."""
    return np.dtype(np.int8 if num_experts - 1 <= 127 else np.int16 if num_experts - 1 <= 32767 else np.int32)


def slime_accepts(rows: int, num_tokens: int, start: int) -> bool:
    """slime: one row per token forwarded, from its own start offset."""
    return rows == num_tokens - 1 - start


@pytest.mark.parametrize(("num_experts", "dtype"), [(8, np.uint8), (128, np.uint8), (129, np.uint8), (300, np.uint16)])
def test_for_nemo_rl_rows_at_their_tokens_sentinel_and_carry_dtype(num_experts: int, dtype: type) -> None:
    prompt_len, output_len, prompt_start = 7, 5, 3  # T = 12
    routed = vllm_rows(12 - 1 - prompt_start, 2, 2, num_experts, dtype=dtype, seed=num_experts)
    rows = replay.for_nemo_rl(align(routed, prompt_len, output_len, prompt_start), num_experts)
    assert rows.shape == (12 - 1, 2, 2) and rows.dtype == nemo_rl_carry_dtype(num_experts)  # valid_len - 1 rows
    assert (rows[:prompt_start] == -1).all()  # NeMo RL's missing-route sentinel: native routing
    np.testing.assert_array_equal(rows[prompt_start:].astype(np.int64), routed.astype(np.int64))  # row t = token t
    if num_experts > 256:
        assert rows.max() > 255 and rows.dtype.kind == "i"  # not the uint16 NeMo RL's conversion fails on


def test_slime_row_count_rule_is_aligns() -> None:
    for prompt_start in (0, 4):
        routed = vllm_rows(9 + 6 - 1 - prompt_start, 2, 2, 8)
        assert slime_accepts(len(routed), 9 + 6, start=prompt_start)  # slime's start offset = prompt_start
        align(routed, 9, 6, prompt_start)  # the same rule
        assert not slime_accepts(len(routed), 9 + 6, start=prompt_start + 1)


# ---- every row sent once: multi-turn conversations, GRPO groups ----


def conversation_rows(turns: int, seed: int = 0) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """One conversation's rows as a full re-request of its last turn returns them (row t = token t), and
    each turn's (context tokens, output tokens): 5 new user tokens and 4 generated per turn."""
    lengths, context = [], 6
    for _ in range(turns):
        lengths.append((context, 4))
        context += 4 + 5
    total = lengths[-1][0] + lengths[-1][1]
    return vllm_rows(total - 1, 3, 2, 8, dense=(1,), seed=seed), lengths


def test_conversation_keeps_each_row_once_and_rebuilds_the_whole() -> None:
    full, lengths = conversation_rows(4)
    conversation = replay.Conversation()
    sent = 0
    for context, output in lengths:
        start = conversation.prompt_start
        routed = full[start : context + output - 1]  # what vLLM 0.22+ returns with routed_experts_prompt_start
        assert conversation.add_turn(routed, context, output, start) == len(routed)
        sent += len(routed)
    whole = conversation.aligned()
    assert sent == len(full) and whole.num_tokens == len(full) + 1 and conversation.nbytes == full.nbytes
    np.testing.assert_array_equal(whole.routes[:-1], full.astype(np.int64))
    resent = sum(context + output - 1 for context, output in lengths)  # every turn re-requesting every row
    assert resent == 2.5 * sent  # 4 turns: 9 + 18 + 27 + 36 rows sent for 36 (multi-turn rows once)
    packed = to_megatron([whole], (0, 2), 8)
    np.testing.assert_array_equal(packed.layer(1)[:-1].numpy(), full[:, 2])


def test_conversation_refuses_a_turn_missing_rows() -> None:
    full, lengths = conversation_rows(2)
    conversation = replay.Conversation()
    (c0, o0), (c1, o1) = lengths
    conversation.add_turn(full[: c0 + o0 - 1], c0, o0, 0)
    with pytest.raises(ValueError, match=r"start at token 11, but 9 rows are held: the rows of tokens 9..10"):
        conversation.add_turn(full[11 : c1 + o1 - 1], c1, o1, 11)
    with pytest.raises(ValueError, match="a turn of 3 context tokens after a conversation of 10"):
        conversation.add_turn(full[:2], 3, 1, 0)


@pytest.mark.parametrize("start", [0, 4, 8, 9])
def test_conversation_keeps_the_held_rows_where_a_turn_resends_some(start: int) -> None:
    """A turn whose rows start before the rows held (every row again, as verl's agent loop asks; or the prefix
    cache's omission, which starts at a KV block): the held rows stay, the re-sent ones are dropped."""
    full, lengths = conversation_rows(2, seed=3)
    conversation = replay.Conversation()
    (c0, o0), (c1, o1) = lengths
    conversation.add_turn(full[: c0 + o0 - 1], c0, o0, 0)
    resent = full[start : c1 + o1 - 1].copy()
    resent[: 9 - start] = 0  # re-sent rows that differ from the held ones (another batch): the held rows win
    assert conversation.add_turn(resent, c1, o1, start) == c1 + o1 - 1 - 9
    np.testing.assert_array_equal(np.concatenate(conversation.aligned().parts), full)


def test_conversation_on_0_20_int32_drops_the_rows_held() -> None:
    full, lengths = conversation_rows(3, seed=2)
    wide = full.astype(np.int32)  # 0.20.x: no prompt_start, every row from token 0 each turn
    conversation = replay.Conversation()
    for context, output in lengths:
        conversation.add_turn(wide[: context + output - 1], context, output, 0)
    np.testing.assert_array_equal(np.concatenate(conversation.aligned().parts), wide)


def test_share_prompt_holds_a_groups_prompt_rows_once() -> None:
    prompt_len, outputs, prompt_start = 12, [5, 9, 1, 7], 2
    prompt = vllm_rows(prompt_len - prompt_start, 3, 2, 8, dense=(1,), seed=1)
    group = [
        np.concatenate([prompt, vllm_rows(out - 1, 3, 2, 8, dense=(1,), seed=10 + i)]) for i, out in enumerate(outputs)
    ]
    shared = replay.share_prompt(group, prompt_len, outputs, prompt_start)
    assert shared.nbytes == sum(g.nbytes for g in group) - (len(group) - 1) * prompt.nbytes
    for i, (routed, out) in enumerate(zip(group, outputs, strict=True)):
        rebuilt, direct = shared.sample(i), align(routed, prompt_len, out, prompt_start)
        assert rebuilt.num_tokens == direct.num_tokens and rebuilt.first == direct.first
        np.testing.assert_array_equal(rebuilt.routes, direct.routes)
    direct = [align(g, prompt_len, out, prompt_start) for g, out in zip(group, outputs, strict=True)]
    packed = to_megatron([shared.sample(i) for i in range(4)], (0, 2), 8, pad_to=4)
    assert torch.equal(packed.ids, to_megatron(direct, (0, 2), 8, pad_to=4).ids)


def test_share_prompt_refuses_prompt_rows_that_differ() -> None:
    prompt_len, outputs = 8, [4, 4]
    group = [vllm_rows(prompt_len + 3, 3, 2, 8, dense=(1,), seed=s) for s in (1, 1)]
    group[1] = group[1].copy()
    group[1][5, 2] = (group[1][5, 2] + 1) % 8  # sample 1 routed prompt token 5 otherwise (no prefix cache)
    with pytest.raises(ValueError, match=r"sample 1's prompt rows differ.*token 5 layer 2.*send its rows whole"):
        replay.share_prompt(group, prompt_len, outputs)
    group[1][5, 2] = group[0][5, 2]
    group[1][prompt_len, 0] = (group[1][prompt_len, 0] + 1) % 8  # a response row: not shared, not compared
    assert len(replay.share_prompt(group, prompt_len, outputs).responses) == 2
    with pytest.raises(ValueError, match="T-1-prompt_start = 10 rows"):
        replay.share_prompt(group, prompt_len, [3, 4])


# ---- the runtime plugin never imports the bridge ----


def test_runtime_modules_do_not_import_the_bridge() -> None:
    """Importing the plugin and every runtime module (all but ``replay`` and ``preflight``, whose replay-check
    trainer replays through the bridge) leaves it out."""
    runtime = sorted(
        module.name
        for module in pkgutil.walk_packages(vllm_ascend_routing.__path__, "vllm_ascend_routing.")
        if not module.name.startswith((f"{replay.__name__}.", "vllm_ascend_routing.preflight"))
        and module.name != replay.__name__
    )
    assert "vllm_ascend_routing.validate" in runtime and "vllm_ascend_routing.integration" in runtime
    code = (
        "import importlib, sys\n"
        f"for name in {runtime!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm_ascend_routing.replay')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_row_contracts_are_the_release_tables() -> None:
    """The bridge's dtype -> row convention is read from the release table, not declared again."""
    from vllm_ascend_routing import releases

    table = {np.dtype(d): (text, takes) for d, (text, takes) in releases.row_contracts().items()}
    assert {d: tuple(c) for d, c in replay.ROW_CONTRACTS.items()} == table
