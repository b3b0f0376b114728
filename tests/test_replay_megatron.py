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

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from vllm_ascend_routing.replay import Aligned, MegatronReplay, align, to_megatron

with warnings.catch_warnings():  # Megatron warns at import that Transformer Engine and Apex are absent
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev environment pins it)")
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # no TE / Apex, unset sizes: fine on a CPU
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One rank, gloo: what Megatron's layers need to be built on a CPU."""
    init = tmp_path_factory.mktemp("megatron") / "process_group"
    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture
def fresh_replay() -> Iterator[None]:
    """Megatron keeps every router's RouterReplay in one process-global list."""
    RouterReplay.clear_global_router_replay_instances()
    yield
    RouterReplay.clear_global_router_replay_instances()


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
) -> Aligned:
    """A request as vLLM returns it (inference's own top-k, dense rows zero), aligned."""
    first = prompt_start if dtype is not np.int32 else 0
    rows = prompt_len + output_len - 1 - first
    routed = np.zeros((rows, num_layers, top_k), dtype=dtype)
    for layer in moe_layers:
        routed[:, layer] = np.argsort(-rng.random((rows, num_experts)), axis=1)[:, :top_k]
    return align(routed, prompt_len, output_len, prompt_start)


def routing_sets(routing_map: torch.Tensor) -> list[frozenset[int]]:
    return [frozenset(torch.nonzero(row).flatten().tolist()) for row in routing_map]


def megatron_routers(moe_pattern: list[int], num_experts: int, top_k: int) -> list[Any]:
    """The routers of a Megatron transformer block with this MoE layer pattern (1 = MoE), in build order."""
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
    block = TransformerBlock(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False))
    routers = [module for module in block.modules() if isinstance(module, TopKRouter)]
    assert [router.router_replay for router in routers] == RouterReplay.global_router_replay_instances
    return routers


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
    samples = [
        vllm_request(rng, 7, 5, num_layers, moe, num_experts, top_k, dtype),
        vllm_request(rng, 9, 3, num_layers, moe, num_experts, top_k, dtype, prompt_start=0 if dtype is np.int32 else 4),
        vllm_request(rng, 2, 6, num_layers, moe, num_experts, top_k, dtype),
    ]
    replay: MegatronReplay = to_megatron(samples, moe, num_experts, pad_to=4)
    routers = megatron_routers([1 if layer in moe else 0 for layer in range(num_layers)], num_experts, top_k)
    assert [router.layer_number for router in routers] == [layer + 1 for layer in moe]  # Megatron counts from 1

    if len(moe) < num_layers:  # dense layers have no router: a tensor per layer is refused by Megatron itself
        with pytest.raises(ValueError, match="does not match instances"):
            RouterReplay.set_replay_data([replay.indices[0]] * num_layers)
    RouterReplay.set_replay_data(replay.indices)
    valid = replay.valid.numpy()
    recorded = np.concatenate([np.pad(s.routes, ((0, (-len(s.routes)) % 4), (0, 0), (0, 0))) for s in samples])
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
    samples = [vllm_request(rng, 11, 6, 4, moe, num_experts, top_k, np.uint16) for _ in range(2)]
    replay = to_megatron(samples, moe, num_experts)
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
        recorded = np.concatenate([s.routes[:, moe[j]] for s in samples])
        np.testing.assert_array_equal(ids.numpy()[replay.valid.numpy()], recorded[replay.valid.numpy()])


def test_megatron_refuses_narrow_ids(fresh_replay: None) -> None:
    """Why to_megatron widens: Megatron gathers with the ids as they come, and gather wants int64."""
    instance = RouterReplay()
    instance.set_target_indices(torch.tensor([[0, 1]], dtype=torch.int16))
    instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(RuntimeError, match="int64|Long"):
        topk_routing_with_score_function(torch.randn(1, 8), 2, router_replay=instance)
