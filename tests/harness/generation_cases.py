# SPDX-License-Identifier: Apache-2.0
"""Cases ``make test`` runs once per vLLM API generation, or once, not on every e2e release.

Two e2e releases share the runner-output generation: 0.23.0 (vLLM's CPU MoE bypassing the router, like Ascend)
and 0.30.0 (the router's capture hook). What differs between them is how the MoE's top-k is captured, which
every capture test (offline batches of every model, compiled and eager, TP 2, DP behind one server, a removed
hook, plugin off, the oracle and its plants) covers on both. A case whose code is the generation's own (the server
under load, the serve scenario's HTTP front end, doctor's and replay-check's reports around the offline engine, an
xlite-style runner where no MoE Python runs at all) runs on ``release_roles.FULL_E2E_RELEASE`` for its generation, and
on the only e2e release of any other generation;
A case whose code is neither (how a process is launched, e.g. a headless DP rank, whose engine's outputs travel
to the front end as a DP server's own engines' do) runs once, on ``release_roles.FULL_E2E_RELEASE``.
``VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE=1`` runs both kinds everywhere.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests import release_roles, settings
from vllm_ascend_routing import releases


def runs_here(release: str) -> bool:
    """Whether this release is where ``make test`` runs its generation's once-per-generation cases."""
    if settings.VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE or release == release_roles.FULL_E2E_RELEASE:
        return True
    here, full = releases.generation_of(release), releases.generation_of(release_roles.FULL_E2E_RELEASE)
    return here is None or full is None or here.generation != full.generation


def connector_scenario(scenario: Any, generation: str, name: str, case: str, arch: str, mooncake: bool = False) -> Any:
    """The result of scenario ``name`` (two engines with a KV connector), once per carrying generation (runner-output
    on its full release, aux-output); ``mooncake``: with the Mooncake kit's environment (scripts/mooncake_kit.py)."""
    from tests.harness import distributed

    if generation in ("shm", "device-cache"):
        pytest.skip(f"vLLM's '{generation}' generation refuses KV connectors (tests/e2e/test_disaggregation.py)")
    once_per_generation(case, distributed.vllm_release())
    if not mooncake:
        return dict(scenario(name, "--arch", arch))
    from tests.scripts import load

    env = load("scripts/mooncake_kit.py", "mooncake_kit").kit(sys.executable).env()
    return dict(scenario(name, "--arch", arch, env=env))


def once_per_generation(case: str, release: str) -> None:
    """Skip ``case`` on a release whose generation's cases run on ``release_roles.FULL_E2E_RELEASE``."""
    if not runs_here(release):
        pytest.skip(
            f"{case} runs once per API generation: on {release_roles.FULL_E2E_RELEASE} for this one (same generation, "
            f"another MoE capture path); VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE=1 runs it on {release} too"
        )


def once(case: str, release: str) -> None:
    """Skip ``case`` except on ``release_roles.FULL_E2E_RELEASE``."""
    if release != release_roles.FULL_E2E_RELEASE and not settings.VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE:
        pytest.skip(
            f"{case} runs once, on {release_roles.FULL_E2E_RELEASE} (it does not depend on the API generation or the "
            f"MoE capture path); VLLM_ASCEND_ROUTING_TEST_EVERY_RELEASE=1 runs it on {release} too"
        )
