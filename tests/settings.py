# SPDX-License-Identifier: Apache-2.0
"""The test suite's own settings (environment variables), read when asked: none of them changes what the plugin
does, so they live with the tests, not in the runtime's ``vllm_ascend_routing.envs``.

The Makefile sets them for its stages (``VLLM_ASCEND_ROUTING_TEST_REQUIRE=vllm ...``); a developer may set them by
hand (``VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE=1 make e2e-0.23.0``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_ascend_routing.envs import flag_reader

if TYPE_CHECKING:
    VLLM_ASCEND_ROUTING_TEST_REQUIRE: str = ""
    VLLM_ASCEND_ROUTING_TEST_SEED: str = ""
    VLLM_ASCEND_ROUTING_TEST_ASCEND_SRC: str = ""
    VLLM_ASCEND_ROUTING_TEST_TRAINER_PYTHONS: str = ""
    VLLM_ASCEND_ROUTING_TEST_TRAINER_RELEASES: str = ""
    VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE: bool = False


def _text(name: str) -> Callable[[], str]:
    return lambda: os.getenv(name, "")


settings: dict[str, Callable[[], Any]] = {
    # Comma-separated test resources (e.g. "vllm") whose absence fails the run instead of skipping.
    "VLLM_ASCEND_ROUTING_TEST_REQUIRE": _text("VLLM_ASCEND_ROUTING_TEST_REQUIRE"),
    # Seed of the random kernel test vectors (default: a fresh one per run, printed).
    "VLLM_ASCEND_ROUTING_TEST_SEED": _text("VLLM_ASCEND_ROUTING_TEST_SEED"),
    # "SRC:OVERLAY" from scripts/ascend_src.py: the real vllm-ascend source the tests/ascend suite runs on.
    "VLLM_ASCEND_ROUTING_TEST_ASCEND_SRC": _text("VLLM_ASCEND_ROUTING_TEST_ASCEND_SRC"),
    # Space-separated Python interpreters of trainer environments (scripts/venv.py trainer-MCORE: verl and a
    # Megatron-Core release) that the trainer hand-off test feeds vLLM's arrays to.
    "VLLM_ASCEND_ROUTING_TEST_TRAINER_PYTHONS": _text("VLLM_ASCEND_ROUTING_TEST_TRAINER_PYTHONS"),
    # vLLM releases besides 0.30.0 the trainer hand-off test runs on (space-separated, or "all").
    "VLLM_ASCEND_ROUTING_TEST_TRAINER_RELEASES": _text("VLLM_ASCEND_ROUTING_TEST_TRAINER_RELEASES"),
    # 1: the e2e cases make test runs once per API generation (tests/harness/generation_cases.py) run on every
    # release, e.g. `VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE=1 make e2e-0.23.0`.
    "VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE": flag_reader("VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE"),
}


def __getattr__(name: str) -> Any:
    if name in settings:
        return settings[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
