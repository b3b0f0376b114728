# SPDX-License-Identifier: Apache-2.0
"""Zero experts (LongCat-Flash): recorded as their own ids ``[E, E + Z)``, accepted by validation and the replay
bridge in that range, and refused where the release's array could not hold them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.fakes import FakeModel
from vllm_ascend_routing import contract, replay, validate
from vllm_ascend_routing.backends import router
from vllm_ascend_routing.compat._common import bind_target_model, refuse_unrepresentable_ids
from vllm_ascend_routing.compat.interface import UnsupportedVllmError

E, Z = 8, 4


def test_the_config_field_is_read_and_absent_means_none() -> None:
    assert contract.zero_experts(SimpleNamespace(zero_expert_num=Z)) == Z
    assert contract.zero_experts(SimpleNamespace(text_config=SimpleNamespace(zero_expert_num=Z))) == Z
    assert contract.zero_experts(SimpleNamespace(zero_expert_num=None)) == 0
    assert contract.zero_experts(SimpleNamespace()) == 0


def test_binding_records_zero_experts_as_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that reports zero experts gets a capture whose valid range includes them: recorded, not -1."""
    monkeypatch.setattr(router, "zero_experts", lambda module: Z, raising=False)
    model = FakeModel(cpu=False, moe_layers=(0, 2), num_layers=3)
    prepared = bind_target_model(model, 8, (3, 2, E), torch.device("cpu"))
    assert (prepared.num_experts, prepared.id_range) == (E, E + Z)
    model.layers[0].router.capture_fn(torch.tensor([[E, 1], [E + Z - 1, E + 1]]))
    model.layers[2].router.capture_fn(torch.tensor([[E + Z, 0]]))  # past the zero experts: invalid
    assert prepared.buffer[:2, 0].tolist() == [[E, 1], [E + Z - 1, E + 1]]
    assert prepared.buffer[0, 2].tolist() == [-1, 0] and int(prepared.errors) == 1


@pytest.mark.parametrize(
    ("routed", "zero", "generation", "refused"),
    [
        (512, 256, "runner-output", False),  # LongCat-Flash: uint16 either way
        (200, 50, "aux-output", False),  # ids up to 249 fit uint8
        (250, 10, "runner-output", True),  # ids 256-259 would wrap in vLLM's uint8
        (250, 10, "aux-output", True),  # the connector narrows as the runner output does
        (256, 1, "runner-output", True),  # 256 routed experts: uint8 holds them, not zero expert 256
        (257, 1, "aux-output", False),  # 257 routed experts: uint16 either way
        (250, 10, "shm", False),  # the plugin's store is sized for them
        (250, 10, "device-cache", False),  # vLLM 0.21.0's arrays are int16
    ],
)
def test_ids_vllm_would_wrap_are_refused(routed: int, zero: int, generation: str, refused: bool) -> None:
    prepared = SimpleNamespace(num_experts=routed, id_range=routed + zero)
    narrowed = _narrowed_by_expert_count(generation)
    if refused:
        with pytest.raises(UnsupportedVllmError, match="ids from 256 on would wrap"):
            refuse_unrepresentable_ids(prepared, narrowed)  # type: ignore[arg-type]
    else:
        refuse_unrepresentable_ids(prepared, narrowed)  # type: ignore[arg-type]


def _narrowed_by_expert_count(generation: str) -> bool:
    """What the generation's adapter passes to ``prepare_capture``."""
    from vllm_ascend_routing import manifest

    api = next(api for api in manifest.adapters() if api.generation.value == generation)
    return bool(api.narrowed_by_expert_count)  # type: ignore[attr-defined]


def test_replay_keeps_zero_expert_ids_past_the_routed_experts_dtype() -> None:
    """250 routed experts fit uint8, their 10 zero experts (ids 250-259) do not: the packed block is sized for
    every id, so zero experts 256-259 reach the router as themselves, not wrapped to experts 0-3."""
    routed = np.array([[[249, 259]], [[256, 3]]])  # [rows, 1 layer, top-2]
    packed = replay.to_megatron([(routed, np.ones(2, dtype=bool))], [0], 250, zero_experts=10)
    assert packed.indices[0].tolist() == [[249, 259], [256, 3]]


def test_validation_and_replay_accept_the_zero_expert_range() -> None:
    routed = np.array([[[E, 1]], [[E + Z - 1, 0]]])  # [rows, 1 layer, top-2]
    model = validate.ModelRouting(E, 1, frozenset({0}), zero_experts=Z)
    assert validate.check(routed, request_id="r", expected_rows=2, model=model) == []
    without = validate.ModelRouting(E, 1, frozenset({0}))
    assert [v.what for v in validate.check(routed, request_id="r", expected_rows=2, model=without)] == [
        f"id outside [0, {E})"
    ] * 2
    assert replay.check(routed, E, [0], zero_experts=Z) == []
    packed = replay.to_megatron([(routed, np.ones(2, dtype=bool))], [0], E, zero_experts=Z)
    assert packed.indices[0].tolist() == [[E, 1], [E + Z - 1, 0]]
    with pytest.raises(ValueError, match=f"id outside \\[0, {E}\\)"):
        replay.to_megatron([(routed, np.ones(2, dtype=bool))], [0], E)
