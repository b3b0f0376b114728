# SPDX-License-Identifier: Apache-2.0
"""A vLLM API generation that exists only for tests/compat/test_registry.py: everything a generation module
provides, in one module (its adapter: runner hooks, runner classes, Patch rows)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import torch

from vllm_ascend_routing.capture import PreparedCapture
from vllm_ascend_routing.compat._runners import LOAD_MODEL
from vllm_ascend_routing.compat.interface import Adapter, RunnerClass, RunnerHook
from vllm_ascend_routing.patching import RELY, Patch


class FakeGeneration(str, enum.Enum):
    FAKE = "fake-output"


class FakeRunner:
    """The runner class this generation hooks (a stand-in for a vLLM model runner)."""

    model: Any = None
    vllm_config: Any = None
    device: Any = None

    def load_model(self) -> None:
        self.model = torch.nn.Linear(1, 1)


PATCHES = (
    Patch(
        "json:dumps", "a symbol the fake generation relies on", "never", (FakeGeneration.FAKE,), ("obj",), action=RELY
    ),
)


class FakeAdapter(Adapter):
    generation = FakeGeneration.FAKE  # type: ignore[assignment]
    patches = PATCHES
    runner_hooks: tuple[RunnerHook, ...] = (LOAD_MODEL,)
    runner_classes: Mapping[str, tuple[RunnerClass, ...]] = {
        "cpu": (RunnerClass("tests.compat.fake_generation:FakeRunner", True),)
    }
    rows_read_in_front_end = False
    prepared: list[Any] = []

    def routed_experts_requested(self, vllm_config: Any) -> bool:
        return True

    def install(self) -> None:
        return None

    def install_ascend(self) -> None:
        return None

    def prepare(self, model: torch.nn.Module, vllm_config: Any, device: torch.device) -> PreparedCapture | None:
        self.prepared.append(model)
        return None

    def attach(self, runner: Any, prepared: PreparedCapture, capturer: Any) -> None:
        return None

    def after_forward(self, runner: Any, prepared: PreparedCapture, num_tokens: int) -> None:
        return None
