# SPDX-License-Identifier: Apache-2.0
"""What doctor finds before any engine starts, as data (the ``--json`` document's keys) and as the report's lines.

The vLLM release and API generation (or why the plugin refuses it), the platform, the kernel backend, every
setting of the plugin with where its value comes from (the environment, its default, or doctor itself, which
runs its engine with the plugin on), every patch target and relied-on symbol checked against the installed
source (``manifest``), one line per class vLLM's own routed-experts binder names, and the versions a maintainer
needs. ``preflight.doctor`` runs them in order and ends in the verdict.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_ascend_routing import envs

DEFAULT, ENVIRONMENT, DOCTOR = "default", "environment", "doctor"  # where a setting's value comes from


def environment(report: dict[str, Any], forced: dict[str, str] | None = None) -> str | None:
    """Fill ``report``'s release, generation, platform, kernel backend and settings; the reason the plugin
    cannot run here (``None`` when it can). ``forced``: the settings doctor set for its engine, with why."""
    from vllm_ascend_routing.compat import UnsupportedVllmError, vllm_version
    from vllm_ascend_routing.compat import adapter as get_adapter

    forced = forced or {}
    problem: str | None = None
    try:
        report["vllm"] = vllm_version()
        report["generation"] = get_adapter().generation.value
    except UnsupportedVllmError as exc:
        problem = report["refused"] = str(exc)
    report["platform"] = platform()
    report["settings"] = []
    for name in envs.environment_variables:
        source = DOCTOR if name in forced else ENVIRONMENT if name in os.environ else DEFAULT
        why = forced.get(name)
        setting: dict[str, Any] = {"name": name, "value": None, "source": source, "why": why, "problem": None}
        try:
            setting["value"] = str(getattr(envs, name))
        except ValueError as exc:  # a malformed setting is a finding, not a crash
            setting["problem"] = str(exc)
            problem = problem or str(exc)
        report["settings"].append(setting)
    from vllm_ascend_routing import ops  # imports torch: after what needs none

    report["kernel_backend"] = ops.kernel_backend()
    return problem


def environment_lines(report: dict[str, Any]) -> list[tuple[str, str]]:
    """``(label, value)`` lines: release, generation, platform, kernel backend, the runtime settings (each with
    where its value comes from), and the tooling settings that are set (the unset ones in one line)."""
    lines: list[tuple[str, str]] = []
    if report["vllm"] is not None:
        lines.append(("vLLM", report["vllm"]))
    if report["refused"] is not None:
        lines.append(("API generation", f"refused: {report['refused']}"))
    elif report["generation"] is not None:
        lines.append(("API generation", report["generation"]))
    lines.append(("platform", str(report["platform"])))
    if report["kernel_backend"] is not None:
        lines.append(("kernel backend", str(report["kernel_backend"])))
    quiet = []
    for setting in report["settings"]:
        if setting["name"] not in envs.runtime_variables and setting["source"] == DEFAULT:
            quiet.append(setting["name"].removeprefix("VLLM_ASCEND_ROUTING_"))
            continue
        lines.append((setting["name"], setting_text(setting)))
    if quiet:
        names = ", _".join(quiet)
        lines.append(("build and tooling settings", f"none set (VLLM_ASCEND_ROUTING_{names})"))
    return lines


def setting_text(setting: dict[str, Any]) -> str:
    if setting["problem"] is not None:
        return f"invalid: {setting['problem']}"
    if setting["source"] == DOCTOR:
        return f"{setting['value']} (set by doctor: {setting['why']})"
    return f"{setting['value']} (default)" if setting["source"] == DEFAULT else str(setting["value"])


def environment_report() -> tuple[list[tuple[str, str]], str | None]:
    """``(label, value)`` lines, and the reason the plugin cannot run here (``None`` when it can)."""
    report: dict[str, Any] = dict.fromkeys(("vllm", "generation", "refused", "platform", "kernel_backend"))
    problem = environment(report)
    return environment_lines(report), problem


def targets(platform: str) -> dict[str, Any]:
    """Every patch target of the detected generation on ``platform`` (vLLM's, and vllm-ascend's where it is
    installed), checked: ``{"generation", "platform", "verified", "total", "rows", "counted"}``."""
    import importlib.util

    from vllm_ascend_routing import manifest
    from vllm_ascend_routing.compat import adapter as get_adapter

    generation = get_adapter().generation
    packages = ["vllm"] + (["vllm_ascend"] if importlib.util.find_spec("vllm_ascend") is not None else [])
    found = [finding for package in packages for finding in manifest.check(generation, platform, package)]
    rows = [
        {
            "target": finding.patch.target,
            "action": finding.patch.action,
            "present": finding.present,
            "problem": finding.problem,
        }
        for finding in found
    ]
    verified = sum(1 for row in rows if row["problem"] is None)
    return {
        "generation": generation.value,
        "platform": platform,
        "verified": verified,
        "total": len(rows),
        "rows": rows,
        "counted": manifest.counted(found),
    }


def target_lines(patches: dict[str, Any]) -> list[str]:
    lines = [
        f"patch targets and relied-on symbols ({patches['generation']}, platform {patches['platform']}): "
        f"{patches['counted']}"
    ]
    for row in patches["rows"]:
        relied = " (relied on)" if row["action"] == "rely" else ""
        if row["problem"] is not None:
            lines.append(f"    MISSING  {row['target']}{relied}: {row['problem']}")
        else:
            lines.append(f"    {'ok' if row['present'] else 'absent here (optional)'}  {row['target']}{relied}")
    return lines


def first_problem(patches: dict[str, Any]) -> str | None:
    return next((row["problem"] for row in patches["rows"] if row["problem"] is not None), None)


def target_report(platform: str) -> tuple[list[str], int, int, str | None]:
    """One line per patch target of the detected generation on ``platform`` (vLLM's, and vllm-ascend's
    where it is installed); ``(lines, verified, total, first problem)``."""
    patches = targets(platform)
    return target_lines(patches), patches["verified"], patches["total"], first_problem(patches)


def binder_coverage() -> dict[str, Any]:
    """Each class vLLM's own binder names in this release, with what the plugin does about it:
    ``{"module_level", "rows", "unknown"}`` (``module_level`` False: vLLM binds in its runner, before 0.28)."""
    from vllm_ascend_routing.backends import upstream

    found = upstream.seams()
    rows = [{"name": seam.name, "known": bool(seam.handling), "handling": seam.handling} for seam in found]
    return {"module_level": bool(found), "rows": rows, "unknown": upstream.unknown_seams() if found else []}


def coverage_lines(binder: dict[str, Any]) -> tuple[list[str], str | None]:
    if not binder["module_level"]:
        return ["binder coverage: vLLM binds layers in its runner here (no module-level binder, before 0.28)"], None
    lines = ["binder coverage (each class vLLM's bind_routed_experts_capturer names):"]
    lines += [
        f"    {'ok' if row['known'] else 'UNKNOWN'}  {row['name']}: {row['handling'] or 'not known'}"
        for row in binder["rows"]
    ]
    if binder["unknown"]:
        return lines, (
            f"vLLM's binder names {', '.join(binder['unknown'])}, which this plugin does not know: a kind of MoE "
            "layer it may bind that the plugin would leave unbound; report it (vllm-ascend-routing does not cover "
            "this vLLM yet)"
        )
    return lines, None


def version_lines(versions: dict[str, Any]) -> list[tuple[str, str]]:
    """The versions ``environment_lines`` does not print already (vLLM is its first line)."""
    commit = f" (commit {versions['commit']}, from the {versions['commit_source']})" if versions["commit"] else ""
    lines = [("vllm-ascend-routing", f"{versions['vllm_ascend_routing']}{commit}")]
    labels = {
        "vllm_ascend": "vllm-ascend",
        "torch": "torch",
        "torch_npu": "torch_npu",
        "cann": "CANN",
        "npu_driver": "NPU driver",
        "cuda_driver": "CUDA driver",
        "device_name": "device",
    }
    lines += [(label, str(versions[key])) for key, label in labels.items() if versions.get(key)]
    return lines


def platform() -> str:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "(vLLM not importable)"
    return str(current_platform.device_type)
