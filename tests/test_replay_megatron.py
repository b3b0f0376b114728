# SPDX-License-Identifier: Apache-2.0
"""The bridge's output through Megatron-Core's own routing replay, on CPU tensors.

Megatron builds its routers (a ``TransformerBlock`` from its GPT layer specs, local backend, one gloo rank),
``RouterReplay.set_replay_data`` takes ``to_megatron``'s tensors, and Megatron's routing
(``TopKRouter.routing``, ``topk_routing_with_score_function``) computes the routing map from the trainer's
own logits: in replay mode it must hold exactly vLLM's ids on every recorded row, for a model with a dense
layer and for more than 256 experts. Not run (needs CUDA): ``TopKRouter.gating`` (the router's linear, which
moves its weight to the GPU; the logits are drawn instead), the token dispatcher and the experts.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from vllm_ascend_routing.replay import (
    Aligned,
    AlignmentError,
    MegatronReplay,
    align,
    check_alignment,
    model_routers,
    recorded_routes,
    set_model_targets,
    to_megatron,
)

# Absent, the tests skip through the ``megatron`` marker (a failure where the run requires it: make
# test-trainer); present but broken, the import fails the module.
if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
    with warnings.catch_warnings():  # Megatron warns at import that Transformer Engine and Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
        from megatron.core.transformer.transformer_block import TransformerBlock
        from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # no TE / Apex, unset sizes: fine on a CPU
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture
def fresh_replay() -> Iterator[None]:
    """Megatron keeps every router's RouterReplay in one process-global list."""
    RouterReplay.clear_global_router_replay_instances()
    yield
    RouterReplay.clear_global_router_replay_instances()


class Request(NamedTuple):
    aligned: Aligned  # the bridge's input: align() of the array as vLLM returned it
    truth: np.ndarray  # [T, num_layers, top_k]: token t's routing as inference chose it, -1 where none was recorded


def vllm_request(
    rng: np.random.Generator,
    prompt_len: int,
    output_len: int,
    num_layers: int,
    moe_layers: tuple[int, ...],
    num_experts: int,
    top_k: int,
    dtype: type,
    prompt_start: int = 0,
) -> Request:
    """A request as vLLM returns it (inference's own top-k, dense rows zero), aligned, and the truth the test
    compares with, placed on the token axis here (not by the bridge)."""
    first = prompt_start if dtype is not np.int32 else 0
    rows = prompt_len + output_len - 1 - first
    routed = np.zeros((rows, num_layers, top_k), dtype=dtype)
    for layer in moe_layers:
        routed[:, layer] = np.argsort(-rng.random((rows, num_experts)), axis=1)[:, :top_k]
    truth = np.full((prompt_len + output_len, num_layers, top_k), -1, dtype=np.int64)
    truth[first : first + rows] = routed
    return Request(align(routed, prompt_len, output_len, prompt_start), truth)


def routing_sets(routing_map: torch.Tensor) -> list[frozenset[int]]:
    return [frozenset(torch.nonzero(row).flatten().tolist()) for row in routing_map]


def megatron_routers(moe_pattern: list[int], num_experts: int, top_k: int) -> list[Any]:
    """The routers of a Megatron transformer block with this MoE layer pattern (1 = MoE), in build order."""
    block = megatron_block(moe_pattern, num_experts, top_k)
    routers = [module for module in block.modules() if isinstance(module, TopKRouter)]
    assert [router.router_replay for router in routers] == RouterReplay.global_router_replay_instances
    return routers


def megatron_block(moe_pattern: list[int], num_experts: int, top_k: int) -> Any:
    """A Megatron transformer block with this MoE layer pattern (1 = MoE), routing replay on."""
    config = TransformerConfig(
        num_layers=len(moe_pattern),
        hidden_size=32,
        num_attention_heads=2,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=8,
        num_moe_experts=num_experts,
        moe_router_topk=top_k,
        moe_layer_freq=moe_pattern,
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        add_bias_linear=False,
    )
    return TransformerBlock(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False))


CASES = {
    # vLLM-side layers (0-based) with a router, experts, top-k, vLLM dtype
    "dense_layer_1": ((0, 2), 3, 8, 2, np.uint8),
    "320_experts": ((0, 1), 2, 320, 8, np.uint16),
    "int32_0_20": ((1, 2), 3, 16, 4, np.int32),
}


@pytest.mark.parametrize("case", CASES)
def test_megatron_replays_vllm_rows(case: str, model_parallel: None, fresh_replay: None) -> None:
    moe, num_layers, num_experts, top_k, dtype = CASES[case]
    rng = np.random.default_rng(0)
    requests = [
        vllm_request(rng, 7, 5, num_layers, moe, num_experts, top_k, dtype),
        vllm_request(rng, 9, 3, num_layers, moe, num_experts, top_k, dtype, prompt_start=0 if dtype is np.int32 else 4),
        vllm_request(rng, 2, 6, num_layers, moe, num_experts, top_k, dtype),
    ]
    replay: MegatronReplay = to_megatron([r.aligned for r in requests], moe, num_experts, pad_to=4)
    routers = megatron_routers([1 if layer in moe else 0 for layer in range(num_layers)], num_experts, top_k)
    assert [router.layer_number for router in routers] == [layer + 1 for layer in moe]  # Megatron counts from 1

    if len(moe) < num_layers:  # dense layers have no router: a tensor per layer is refused by Megatron itself
        with pytest.raises(ValueError, match="does not match instances"):
            RouterReplay.set_replay_data([replay.indices[0]] * num_layers)
    RouterReplay.set_replay_data(replay.indices)
    valid = replay.valid.numpy()
    recorded = np.concatenate([np.pad(r.truth, ((0, (-len(r.truth)) % 4), (0, 0), (0, 0))) for r in requests])
    num_tokens = len(valid)
    torch.manual_seed(0)
    trainer_logits = [torch.randn(num_tokens, 1, num_experts) for _ in moe]  # [seq, batch, experts], THD: batch 1

    with torch.no_grad():
        natural = [
            routing_sets(router.routing(logits)[1]) for router, logits in zip(routers, trainer_logits, strict=True)
        ]
        for action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):  # forward, recompute
            RouterReplay.set_global_router_replay_action(action)
            for j, (router, logits) in enumerate(zip(routers, trainer_logits, strict=True)):
                probs, routing_map = router.routing(logits)
                got = routing_sets(routing_map)
                want = [frozenset(row.tolist()) for row in recorded[:, moe[j]]]
                assert all(got[n] == want[n] for n in np.nonzero(valid)[0]), f"layer {moe[j]}: {action}"
                assert (routing_map.sum(dim=1) == top_k).all()  # filler rows too: top_k distinct experts
                # Replay gathers the trainer's scores at vLLM's ids (softmax over the top-k logits).
                ids = replay.indices[j]
                expected = torch.softmax(logits.view(num_tokens, -1).gather(1, ids), dim=-1)
                torch.testing.assert_close(probs.gather(1, ids), expected)
        RouterReplay.clear_global_router_replay_action()
    # The trainer's own routing differs from inference's: the test could fail.
    assert sum(natural[0][n] != frozenset(recorded[n, moe[0]].tolist()) for n in np.nonzero(valid)[0]) > 0


def test_megatron_sigmoid_group_limited_routing_replays(fresh_replay: None) -> None:
    """DeepSeek-V3-style routing (sigmoid, expert bias, group-limited, scaled), 320 experts, via the routing
    function with one RouterReplay per MoE layer."""
    num_experts, top_k, moe = 320, 8, (1, 3)
    rng = np.random.default_rng(1)
    requests = [vllm_request(rng, 11, 6, 4, moe, num_experts, top_k, np.uint16) for _ in range(2)]
    replay = to_megatron([r.aligned for r in requests], moe, num_experts)
    instances = [RouterReplay() for _ in moe]
    RouterReplay.set_replay_data(replay.indices)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    torch.manual_seed(1)
    for j, instance in enumerate(instances):
        logits = torch.randn(len(replay.valid), num_experts)
        bias = torch.randn(num_experts) * 0.1
        probs, routing_map = topk_routing_with_score_function(
            logits,
            top_k,
            num_groups=8,
            group_topk=4,
            scaling_factor=2.5,
            score_function="sigmoid",
            expert_bias=bias,
            router_replay=instance,
        )
        ids = replay.indices[j]
        assert routing_sets(routing_map) == [frozenset(row.tolist()) for row in ids]
        scores = torch.sigmoid(logits).gather(1, ids)  # without the bias, as Megatron gathers them
        torch.testing.assert_close(probs.gather(1, ids), 2.5 * scores / scores.sum(dim=1, keepdim=True))
        recorded = np.concatenate([r.truth[:, moe[j]] for r in requests])
        np.testing.assert_array_equal(ids.numpy()[replay.valid.numpy()], recorded[replay.valid.numpy()])


def test_megatron_refuses_narrow_ids(fresh_replay: None) -> None:
    """Why to_megatron widens: Megatron gathers with the ids as they come, and gather wants int64."""
    instance = RouterReplay()
    instance.set_target_indices(torch.tensor([[0, 1]], dtype=torch.int16))
    instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(RuntimeError, match="int64|Long"):
        topk_routing_with_score_function(torch.randn(1, 8), 2, router_replay=instance)


# ---- the model's own routers, rows without recorded routing kept native ----


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_keep_native_follows_each_micro_batch_into_its_recompute(order: str, fresh_replay: None) -> None:
    """Two micro-batches set before their recomputes (as pipeline schedules do): each recompute keeps its own
    micro-batch's rows native, whichever end of the backward list the class takes it from (stock: the first)."""
    from vllm_ascend_routing.replay import keep_native

    class LastFirst(RouterReplay):  # a RouterReplay that recomputes the newest micro-batch first
        def get_replay_topk(self, scores: Any, topk: int, *args: Any, **kwargs: Any) -> Any:
            if self.router_replay_action == RouterReplayAction.REPLAY_BACKWARD:
                top = self.replay_backward_list.pop()
                return scores.gather(1, top), top
            return super().get_replay_topk(scores, topk, *args, **kwargs)

    instance = RouterReplay() if order == "fifo" else LastFirst()
    ids = [torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]), torch.tensor([[7, 6], [5, 4], [3, 2], [1, 0]])]
    masks = [torch.tensor([True, False, True, False]), torch.tensor([False, True, True, True])]
    torch.manual_seed(3)
    logits = torch.randn(4, 8)
    native = routing_sets(topk_routing_with_score_function(logits, 2)[1])

    def routed(action: Any) -> list[frozenset[int]]:
        instance.set_router_replay_action(action)
        return routing_sets(topk_routing_with_score_function(logits, 2, router_replay=instance)[1])

    def want(m: int) -> list[frozenset[int]]:
        return [frozenset(ids[m][n].tolist()) if masks[m][n] else native[n] for n in range(4)]

    for m in (0, 1):  # each micro-batch's forward
        instance.set_target_indices(ids[m])
        keep_native(instance, ids[m], masks[m])
        assert routed(RouterReplayAction.REPLAY_FORWARD) == want(m)
    for m in (0, 1) if order == "fifo" else (1, 0):  # the recomputes
        assert routed(RouterReplayAction.REPLAY_BACKWARD) == want(m), f"recompute of micro-batch {m}"


def route(routers: list[Any], logits: list[torch.Tensor]) -> list[list[frozenset[int]]]:
    with torch.no_grad():
        return [routing_sets(router.routing(x)[1]) for router, x in zip(routers, logits, strict=True)]


def set_action(routers: list[Any], action: Any) -> None:
    for router in routers:
        router.router_replay.set_router_replay_action(action)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_prompt_start_rows_stay_native_through_the_recipe(
    dtype: type, model_parallel: None, fresh_replay: None
) -> None:
    """prompt_start = 3: the 3 prompt rows before it, each sample's last token and the padding are routed by
    the trainer's own top-k, in REPLAY_FORWARD and REPLAY_BACKWARD; every other row is vLLM's."""
    moe, num_layers, num_experts, top_k = (0, 2), 3, (8 if dtype is np.uint8 else 288), 2
    rng = np.random.default_rng(2)
    requests = [
        vllm_request(rng, 7, 5, num_layers, moe, num_experts, top_k, dtype, prompt_start=3),
        vllm_request(rng, 5, 4, num_layers, moe, num_experts, top_k, dtype, prompt_start=3),
    ]
    data = to_megatron([r.aligned for r in requests], moe, num_experts, pad_to=8)  # 12 + 4 padding, 9 + 7 padding
    block = megatron_block([1, 0, 1], num_experts, top_k)
    assert set_model_targets(block, data) == [0, 2]
    routers = [router for _, router in model_routers(block)]
    torch.manual_seed(2)
    logits = [torch.randn(len(data.valid), 1, num_experts) for _ in moe]
    native = route(routers, logits)
    recorded = np.concatenate([np.pad(r.truth, ((0, (-len(r.truth)) % 8), (0, 0), (0, 0))) for r in requests])
    valid = data.valid.numpy()
    assert valid.sum() == (7 + 5 - 1 - 3) + (5 + 4 - 1 - 3) and (~valid).sum() == 3 + 1 + 4 + 3 + 1 + 7
    for action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
        set_action(routers, action)
        for j, got in enumerate(route(routers, logits)):
            for n in range(len(valid)):
                want = frozenset(recorded[n, moe[j]].tolist()) if valid[n] else native[j][n]
                assert got[n] == want, f"{action}: layer {moe[j]} row {n} ({'replayed' if valid[n] else 'native'})"
    # The filler ids would have been replayed without the mask: the test could fail.
    fillers = [frozenset(row.tolist()) for row in data.indices[0][~data.valid]]
    assert fillers != [native[0][n] for n in np.nonzero(~valid)[0]]


def test_model_scoped_targets_survive_a_rebuilt_decoder_and_a_reference_model(
    model_parallel: None, fresh_replay: None
) -> None:
    """Megatron's global list holds every router ever built: a decoder built and discarded, then the policy,
    then a reference model. The positional form hands the policy's routers another model's rows (or refuses
    the count); walking the policy reaches its own."""
    num_experts, top_k, moe = 8, 2, (0, 2)
    rng = np.random.default_rng(3)
    request = vllm_request(rng, 6, 6, 3, moe, num_experts, top_k, np.uint8)
    data = to_megatron([request.aligned], moe, num_experts)
    megatron_block([1, 0, 1], num_experts, top_k)  # discarded (e.g. rebuilt with other settings)
    policy = megatron_block([1, 0, 1], num_experts, top_k)
    megatron_block([1, 0, 1], num_experts, top_k)  # the reference model
    with pytest.raises(ValueError, match="does not match instances"):
        RouterReplay.set_replay_data(data.indices)
    set_model_targets(policy, data)
    routers = [router for _, router in model_routers(policy)]
    set_action(routers, RouterReplayAction.REPLAY_FORWARD)
    logits = [torch.randn(len(data.valid), 1, num_experts) for _ in moe]
    valid = np.nonzero(data.valid.numpy())[0]
    for j, got in enumerate(route(routers, logits)):
        assert [got[n] for n in valid] == [frozenset(request.truth[n, moe[j]].tolist()) for n in valid]
    others = RouterReplay.global_router_replay_instances
    assert all(r.target_topk_idx is None for r in others if all(r is not x.router_replay for x in routers))


def test_model_routers_leave_mtp_out_and_refuse_foreign_layers(model_parallel: None, fresh_replay: None) -> None:
    num_experts, top_k = 8, 2

    class WithMTP(torch.nn.Module):  # GPTModel's layout: the MTP block is the decoder's sibling
        def __init__(self) -> None:
            super().__init__()
            self.decoder = megatron_block([1, 0, 1], num_experts, top_k)
            self.mtp = megatron_block([1], num_experts, top_k)

    model = WithMTP()
    assert [layer for layer, _ in model_routers(model)] == [0, 2]
    assert [layer for layer, _ in model_routers([model.decoder])] == [0, 2]  # VPP chunks: a list
    rng = np.random.default_rng(4)
    request = vllm_request(rng, 5, 3, 3, (0, 1), num_experts, top_k, np.uint8).aligned
    with pytest.raises(ValueError, match=r"routes layer 2 .* MoE layers \[0, 1\]: read moe_layers"):
        set_model_targets(model, to_megatron([request], (0, 1), num_experts))
    with pytest.raises(ValueError, match="two routers"):
        both = vllm_request(rng, 5, 3, 3, (0, 2), num_experts, top_k, np.uint8).aligned
        set_model_targets([model.decoder, model.decoder], to_megatron([both], (0, 2), num_experts))


def test_shift_check_against_megatron_recorded_routing(model_parallel: None, fresh_replay: None) -> None:
    """A RECORD forward gives the trainer's own routing; rows in place pass, rows shifted by one are refused."""
    num_experts, top_k, moe = 8, 2, (0, 2)
    rng = np.random.default_rng(5)
    request = vllm_request(rng, 9, 7, 3, moe, num_experts, top_k, np.uint8)
    data = to_megatron([request.aligned], moe, num_experts)
    block = megatron_block([1, 0, 1], num_experts, top_k)
    routers = [router for _, router in model_routers(block)]
    # The trainer's logits favour inference's experts (as a trainer with the same weights does), with noise.
    logits = [torch.randn(len(data.valid), 1, num_experts) for _ in moe]
    for j, x in enumerate(logits):
        chosen = torch.from_numpy(np.where(request.truth[:, moe[j]] < 0, 0, request.truth[:, moe[j]]))
        x.view(-1, num_experts).scatter_add_(1, chosen, torch.full(chosen.shape, 4.0))
    set_action(routers, RouterReplayAction.RECORD)
    route(routers, logits)
    recorded = recorded_routes(block, data.layers)
    assert check_alignment(data, recorded) > 0.8  # most rows, as a trainer with the same weights
    shifted = align(np.roll(request.truth[:-1].astype(np.uint8), 1, axis=0), 9, 7)
    with pytest.raises(AlignmentError, match="row t must be token t"):
        check_alignment(to_megatron([shifted], moe, num_experts), recorded)


@pytest.fixture
def verl_router_replay() -> Iterator[Any]:
    """verl's patched ``RouterReplay`` on Megatron's routers (``apply_router_replay_patch``), for this test only:
    the classes verl patches get their attributes back afterwards."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from verl.utils.megatron import router_replay_patch

    patched = (TopKRouter, TransformerConfig, MoEAlltoAllTokenDispatcher)
    saved = [dict(vars(cls)) for cls in patched]
    router_replay_patch.RouterReplay.router_instances.clear()
    router_replay_patch.apply_router_replay_patch()
    yield router_replay_patch.RouterReplay
    router_replay_patch.RouterReplay.router_instances.clear()
    for cls, before in zip(patched, saved, strict=True):
        for name in set(vars(cls)) - set(before):
            delattr(cls, name)
        for name, value in before.items():
            if vars(cls).get(name) is not value:
                setattr(cls, name, value)


@pytest.mark.verl
def test_the_mask_in_verls_form(model_parallel: None, fresh_replay: None, verl_router_replay: Any) -> None:
    """Under verl's patched RouterReplay the bridge hands the mask to ``set_target_indices(idx, replay_mask=...)``
    (verl's own native fallback): prompt_start = 3 rows, the last token and padding stay native."""
    num_experts, top_k, moe = 8, 2, (0, 2)
    rng = np.random.default_rng(6)
    request = vllm_request(rng, 8, 5, 3, moe, num_experts, top_k, np.uint8, prompt_start=3)
    data = to_megatron([request.aligned], moe, num_experts, pad_to=8)
    block = megatron_block([1, 0, 1], num_experts, top_k)
    routers = [router for _, router in model_routers(block)]
    assert all(isinstance(router.router_replay, verl_router_replay) for router in routers)
    set_model_targets(block, data)
    assert all(router.router_replay.target_replay_mask is data.valid for router in routers)  # verl's own path
    assert all("_vllm_ascend_routing_native" not in vars(router.router_replay) for router in routers)
    logits = [torch.randn(len(data.valid), 1, num_experts) for _ in moe]
    native = route(routers, logits)
    from verl.utils.megatron.router_replay_patch import RouterReplayAction as VerlReplayAction

    set_action(routers, VerlReplayAction.REPLAY_FORWARD)
    valid = data.valid.numpy()
    replayed = 0
    for j, got in enumerate(route(routers, logits)):
        for n in range(len(valid)):
            want = frozenset(request.truth[n, moe[j]].tolist()) if valid[n] else native[j][n]
            assert got[n] == want, f"layer {moe[j]} row {n}"
        replayed += int(valid.sum())
    assert replayed == 2 * (8 + 5 - 1 - 3)
