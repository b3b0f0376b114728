# SPDX-License-Identifier: Apache-2.0
"""The trainer side of replay-check, without vLLM: transformers records the routes (float32, as inference),
a bfloat16 trainer replays them. Replay must beat natural routing, and two classic consumer mistakes (rows
shifted by one token, the dense layer mis-indexed) must score worse than correct replay.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from vllm_ascend_routing.preflight import models, scenarios
from vllm_ascend_routing.preflight.trainer import Mismatch, TrainerModel
from vllm_ascend_routing.replay import Aligned, MegatronReplay, align, to_megatron
from vllm_ascend_routing.replay.aligned import INVALID

RESPONSE = 24


def requests(count: int = 6) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) token ids; the response is any token sequence (its log-probs are what is compared)."""
    rng = np.random.default_rng(0)
    return [
        (p, [int(t) for t in rng.integers(4, models.VOCAB_SIZE, RESPONSE)])
        for p in models.mixed_prompts(count, seed=3, min_len=8, max_len=40)
    ]


def recorded(inference: TrainerModel, prompt: list[int], response: list[int]) -> tuple[Aligned, np.ndarray]:
    """What vLLM would return (0.22+ contract: uint8 rows of prompt + output[:-1]), aligned, and the log-probs."""
    forward = inference.forward(prompt + response)
    return align(forward.routes[:-1].astype(np.uint8), len(prompt), len(response)), forward.logprobs[len(prompt) - 1 :]


def shifted_by_one(aligned: Aligned) -> tuple[np.ndarray, np.ndarray]:
    """A consumer that puts row i on token i + 1: ``(routes, valid)``, the pair form ``to_megatron`` takes."""
    routes, valid = np.full_like(aligned.routes, INVALID), np.zeros_like(aligned.valid)
    routes[1:], valid[1:] = aligned.routes[:-1], aligned.valid[:-1]
    return routes, valid


def dense_misindexed(aligned: Aligned, num_moe_layers: int) -> MegatronReplay:
    """A consumer that gives the j-th MoE layer column j (MoE ordinal taken for the layer number): with a dense
    layer in between, later MoE layers get the wrong layer's rows (here the dense layer's zeros)."""
    columns = np.where(aligned.valid[:, None, None], aligned.routes, 0)
    return MegatronReplay(
        [torch.from_numpy(columns[:, j].copy()) for j in range(num_moe_layers)], torch.from_numpy(aligned.valid)
    )


def model(arch: str) -> Any:
    return models.build_tiny_moe(arch, scenarios.model_dir() / arch)


@pytest.mark.parametrize("arch", models.ARCHITECTURES)
def test_forcing_the_models_own_routes_changes_nothing(arch: str) -> None:
    """Forced weights are gathered from the full scores exactly as each router weighs its own top-k."""
    info = model(arch)
    trainer = TrainerModel(info.path, "float32")
    for prompt, response in requests(2):
        aligned, _ = recorded(trainer, prompt, response)
        natural = trainer.forward(prompt + response)
        forced = trainer.forward(prompt + response, to_megatron([aligned], info.moe_layers, info.num_experts))
        np.testing.assert_allclose(forced.logprobs, natural.logprobs, atol=1e-6)
        np.testing.assert_array_equal(forced.routes, natural.routes)


def test_replay_beats_natural_and_the_controls_score_worse() -> None:
    info = model("qwen3_moe_dense")  # layer 1 dense
    inference, trainer = TrainerModel(info.path, "float32"), TrainerModel(info.path, "bfloat16")
    assert trainer.moe_layers == info.moe_layers == (0, 2)
    scores = {name: Mismatch() for name in ("natural", "replay", "shifted", "dense_misindexed")}
    for prompt, response in requests():
        aligned, infer_logprobs = recorded(inference, prompt, response)
        tokens = prompt + response
        runs = {
            "natural": None,
            "replay": to_megatron([aligned], info.moe_layers, info.num_experts),
            "shifted": to_megatron([shifted_by_one(aligned)], info.moe_layers, info.num_experts),
            "dense_misindexed": dense_misindexed(aligned, len(info.moe_layers)),
        }
        for name, replay in runs.items():
            scores[name].add(
                trainer.forward(tokens, replay),
                infer_logprobs,
                aligned.routes,
                aligned.valid,
                info.moe_layers,
                len(prompt),
            )
    natural, replay = scores["natural"], scores["replay"]
    assert replay.agreement == 1.0 and replay.rows == natural.rows > 0
    assert natural.agreement < 1.0, "bfloat16 routing should diverge somewhere, or the comparison shows nothing"
    assert replay.k3 < natural.k3 and replay.mean_abs < natural.mean_abs
    for control in ("shifted", "dense_misindexed"):
        worse = scores[control]
        assert worse.agreement < replay.agreement, control
        assert worse.k3 > replay.k3 and worse.mean_abs > replay.mean_abs, control


def test_mismatch_statistics() -> None:
    mismatch = Mismatch()
    routes = np.zeros((4, 2, 2), dtype=np.int64)
    routes[:, 0] = [[0, 1], [2, 3], [4, 5], [6, 7]]
    trained = routes.copy()
    trained[1, 0] = [3, 2]  # same set, other order: agrees
    trained[2, 0] = [4, 6]
    valid = np.array([True, True, True, False])
    forward = type("F", (), {"logprobs": np.log([0.5, 0.5, 0.25]), "routes": trained})()
    mismatch.add(forward, np.log([0.125, 0.2]), routes, valid, (0,), prompt_len=2)  # response: tokens 2, 3
    assert (mismatch.rows, mismatch.agreeing) == (3, 2)
    delta = np.log([4.0, 1.25])
    assert mismatch.tokens == 2 and mismatch.max_abs == pytest.approx(np.log(4.0))
    assert mismatch.k3 == pytest.approx(np.mean(np.exp(delta) - 1 - delta))
    assert mismatch.over_ln2 == 0.5 and mismatch.mean_abs == pytest.approx(np.mean(delta))
