# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_ascend_routing doctor``: what the plugin would do here, then a self-check.

Prints the vLLM release, the API generation (or why it is refused), the platform, the kernel backend,
every setting and every patch target the plugin relies on for that generation and platform, each checked
against the installed source (``manifest``), and one line per kind of layer vLLM's own binder binds in that
release, with whether the plugin binds it or leaves it to vLLM (a kind the plugin does not know fails).
``--surface`` stops there (a release that cannot run here, e.g. a CUDA-only wheel):
``PASS (static: N/N targets verified)``.

Then runs vLLM with the plugin on the embedded tiny MoE in the platform's dtype (``--dtype``: float32 on the
CPU, bfloat16 or float16 on GPUs and NPUs, the KV cache sized the platform's way) and compares every returned
row with the float32 transformers reference, counting the near-tie flips that dtype's rounding allows.
``--model PATH`` runs the user's own model instead (``model_check``). Ends with
``vllm-ascend-routing doctor: PASS`` or ``... FAIL: <reason>``; exit status 0 / 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from vllm_ascend_routing import envs

VERDICT = "vllm-ascend-routing doctor: "  # prefix of the last line (vLLM workers may log after it)
PLATFORMS = ("cuda", "cpu", "npu")  # runner_mixin.RUNNER_CLASSES (not imported: doctor loads lazily)
DTYPES = ("auto", "float32", "bfloat16", "float16")


def environment_report() -> tuple[list[tuple[str, str]], str | None]:
    """``(label, value)`` lines, and the reason the plugin cannot run here (``None`` when it can)."""
    from vllm_ascend_routing import ops
    from vllm_ascend_routing.compat import UnsupportedVllmError, get_api, vllm_version

    lines: list[tuple[str, str]] = []
    problem: str | None = None
    try:
        lines.append(("vLLM", vllm_version()))
        lines.append(("API generation", get_api().generation.value))
    except UnsupportedVllmError as exc:
        problem = str(exc)
        lines.append(("API generation", f"refused: {exc}"))
    lines.append(("platform", _platform()))
    lines.append(("kernel backend", ops.kernel_backend()))
    for name in envs.environment_variables:
        try:
            value = str(getattr(envs, name))
        except ValueError as exc:  # a malformed setting is a finding, not a crash
            value, problem = f"invalid: {exc}", problem or str(exc)
        lines.append((name, value if name in os.environ else f"{value} (default)"))
    return lines, problem


def target_report(platform: str) -> tuple[list[str], int, int, str | None]:
    """One line per patch target of the detected generation on ``platform`` (vLLM's, and vllm-ascend's
    where it is installed); ``(lines, verified, total, first problem)``."""
    import importlib.util

    from vllm_ascend_routing import manifest
    from vllm_ascend_routing.compat import get_api

    generation = get_api().generation
    packages = ["vllm"] + (["vllm_ascend"] if importlib.util.find_spec("vllm_ascend") is not None else [])
    findings = [finding for package in packages for finding in manifest.check(generation, platform, package)]
    lines = [f"patch targets ({generation.value}, platform {platform}):"]
    for finding in findings:
        if finding.problem is not None:
            lines.append(f"    MISSING  {finding.patch.target}: {finding.problem}")
        else:
            state = "ok" if finding.present else "absent here (optional)"
            lines.append(f"    {state}  {finding.patch.target}")
    problems = [finding.problem for finding in findings if finding.problem is not None]
    return lines, len(findings) - len(problems), len(findings), problems[0] if problems else None


def coverage_report() -> tuple[list[str], str | None]:
    """One line per kind of layer vLLM's own binder binds in this release (each class it names), with what the
    plugin does about it; the problem when it names one the plugin does not know (it could lose those rows)."""
    from vllm_ascend_routing.backends import upstream

    found = upstream.seams()
    if not found:
        return ["binder coverage: vLLM binds layers in its runner here (no module-level binder, before 0.28)"], None
    lines = ["binder coverage (each class vLLM's bind_routed_experts_capturer names):"]
    lines += [
        f"    {'ok' if seam.handling else 'UNKNOWN'}  {seam.name}: {seam.handling or 'not known'}" for seam in found
    ]
    unknown = upstream.unknown_seams()
    if unknown:
        return lines, (
            f"vLLM's binder names {', '.join(unknown)}, which this plugin does not know: a kind of MoE layer it "
            "may bind that the plugin would leave unbound; report it (vllm-ascend-routing does not cover this vLLM yet)"
        )
    return lines, None


def _platform() -> str:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "(vLLM not importable)"
    return str(current_platform.device_type)


def self_check(num_prompts: int, mode: str, dtype: str = "float32") -> tuple[bool, str]:
    """Run the embedded tiny MoE through vLLM with the plugin in ``dtype``; every row must equal the float32
    reference, but for near-ties within ``dtype``'s rounding, which are counted (``compare.tie_tolerance``)."""
    os.environ["VLLM_ASCEND_ROUTING"] = "1"  # before the engine starts: the plugin loads with vLLM
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm_ascend_routing.selfcheck import scenarios

    result = scenarios.run_offline(self_check_model(dtype), mode, num_prompts, dtype=dtype)
    parts = [(name, result[name]) for name in ("batch", "chunked_prefill", "prefix_repeat")]
    summary = ", ".join(f"{name} {part['matched']}/{part['rows']} rows exact" for name, part in parts)
    ties = sum(int(part["near_ties"]) for _, part in parts)
    summary += f" ({ties} of them near-tie flips within {dtype} rounding)" if ties else ""
    failed = [f"{name}: {'; '.join(part['problems']) or 'mismatch'}" for name, part in parts if not part["ok"]]
    capture, problems = capture_report()
    failed += problems
    return not failed, f"{summary}; {capture}" if not failed else "; ".join(failed)


def self_check_model(dtype: str) -> str:
    """float32: the e2e suite's Qwen3-MoE; below it, the variant whose routing margins survive the dtype."""
    return "qwen3_moe" if dtype == "float32" else "qwen3_moe_robust"


def resolve_dtype(dtype: str) -> str:
    """``auto``: the platform's choice (``selfcheck.offline.platform_dtype``); anything else as given."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    from vllm_ascend_routing.selfcheck import offline

    return offline.platform_dtype()


def capture_report() -> tuple[str, list[str]]:
    """The captures the self-check's in-process engine prepared (bound layers) and what the always-on
    check (``sentinel``) counted over the run: rows checked, all-zero rows, invalid ids (stored as -1)."""
    from vllm_ascend_routing import runner_state, sentinel

    captures = runner_state.captures_in_process()
    if not captures:
        return "capture counters not visible from this process", []
    layers = sum(capture.num_bound_layers for capture in captures)
    seen = sentinel.stats()
    problems = []
    if seen.zero_rows:
        problems.append(f"{seen.zero_rows} all-zero routing rows (a MoE layer's capture bypassed)")
    if seen.invalid_ids:
        problems.append(f"{seen.invalid_ids} out-of-range expert ids recorded (stored as -1)")
    return (
        f"{layers} MoE layers bound; {seen.rows_checked} rows in {seen.steps_checked} steps checked: "
        f"{seen.zero_rows} all-zero, {seen.invalid_ids} invalid ids"
    ), problems


def _print(line: str) -> None:
    print(line, flush=True)


def run(
    num_prompts: int = 4,
    mode: str = "compiled",
    print_fn: Callable[[str], Any] = _print,
    surface: bool = False,
    platform: str | None = None,
    dtype: str = "auto",
    model: str | None = None,
    model_options: dict[str, Any] | None = None,
) -> int:
    """The report, then the self-check in ``dtype`` (or, with ``model``, ``model_check`` on the user's model with
    ``model_options``: tensor_parallel_size, max_tokens, trust_remote_code); 0 on PASS, 1 on FAIL."""
    lines, problem = environment_report()
    width = max(len(label) for label, _ in lines)
    print_fn("vllm-ascend-routing doctor")
    for label, value in lines:
        print_fn(f"  {label:<{width}}  {value}")
    if problem is not None:
        print_fn(f"{VERDICT}FAIL: {problem}")
        return 1
    platform = platform or _platform()
    if platform not in PLATFORMS:
        print_fn(
            f"{VERDICT}FAIL: vLLM reports platform {platform!r}, which has no patch targets here; pass "
            f"--platform ({', '.join(PLATFORMS)}) to check a release this machine cannot run"
        )
        return 1
    target_lines, verified, total, missing = target_report(platform)
    for line in target_lines:
        print_fn(f"  {line}")
    if missing is not None:
        print_fn(f"{VERDICT}FAIL: {missing}")
        return 1
    coverage_lines, uncovered = coverage_report()
    for line in coverage_lines:
        print_fn(f"  {line}")
    if uncovered is not None:
        print_fn(f"{VERDICT}FAIL: {uncovered}")
        return 1
    if surface:
        print_fn(f"{VERDICT}PASS (static: {verified}/{total} targets verified)")
        return 0
    if model is not None:
        from vllm_ascend_routing import model_check

        ok, detail = model_check.run(model, print_fn, num_prompts, dtype=dtype, mode=mode, **(model_options or {}))
        print_fn(f"  {detail}")
        print_fn(f"{VERDICT}PASS" if ok else f"{VERDICT}FAIL: {detail}")
        return 0 if ok else 1
    chosen = resolve_dtype(dtype)
    print_fn(
        f"self-check: tiny Qwen3-MoE ({self_check_model(chosen)}), {num_prompts} prompts, {mode}, {chosen}, "
        "against float32 transformers ..."
    )
    ok, detail = self_check(num_prompts, mode, chosen)
    print_fn(f"  {detail}")
    print_fn(f"{VERDICT}PASS" if ok else f"{VERDICT}FAIL: {detail}")
    return 0 if ok else 1
