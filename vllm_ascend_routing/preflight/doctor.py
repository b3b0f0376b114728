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

Every report starts with the versions a maintainer needs (``versions``: this package and its commit, vLLM,
vllm-ascend, torch, torch_npu, CANN, the driver and the device's name where present).

``--json`` (``run_json``): the same checks; the report above goes to stderr (with vLLM's own logging) and
stdout holds one line, the JSON document ``run`` filled in (``new_report``: the keys tools read).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from vllm_ascend_routing import envs

VERDICT = "vllm-ascend-routing doctor: "  # prefix of the last line (vLLM workers may log after it)
PLATFORMS = ("cuda", "cpu", "npu")  # runner_mixin.RUNNER_CLASSES (not imported: doctor loads lazily)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The JSON document's first key and value: a tool finds the document by it among vLLM's log lines, and the
# number changes when a key changes meaning.
SCHEMA = "vllm-ascend-routing-doctor/1"
PARTS = ("batch", "chunked_prefill", "prefix_repeat")  # the self-check's scenarios, in the order printed


def new_report() -> dict[str, Any]:
    """The ``--json`` document before any check ran: every key present, ``None`` where a stage did not run."""
    return {
        "schema": SCHEMA,
        "versions": None,  # versions.collect(): package and commit, vLLM, vllm-ascend, torch(_npu), CANN, driver
        "vllm": None,  # the installed release; None where vLLM is not importable
        "generation": None,  # the API generation detected; None where refused
        "refused": None,  # why the plugin refuses this release
        "platform": None,  # the one the patch targets were checked for (--platform, else vLLM's)
        "kernel_backend": None,
        "settings": [],  # {"name", "value", "default", "problem"}
        "patches": None,  # {"generation", "platform", "verified", "total", "rows": [{"target", "present", "problem"}]}
        "binder": None,  # {"module_level", "rows": [{"name", "known", "handling"}], "unknown": [names]}
        "self_check": None,  # self_check's dict
        # {"model", "ok", "detail", "engine_flags", "engine_options", "consistency", "workload"}
        "model_check": None,
        "verdict": None,  # {"ok", "stage", "reason", "text"}: text is the last line less VERDICT
        "exit_status": None,
    }


def environment(report: dict[str, Any] | None = None) -> str | None:
    """Fill ``report``'s release, generation, platform, kernel backend and settings; the reason the plugin
    cannot run here (``None`` when it can)."""
    from vllm_ascend_routing import ops
    from vllm_ascend_routing.compat import UnsupportedVllmError, get_api, vllm_version

    report = new_report() if report is None else report
    problem: str | None = None
    try:
        report["vllm"] = vllm_version()
        report["generation"] = get_api().generation.value
    except UnsupportedVllmError as exc:
        problem = report["refused"] = str(exc)
    report["platform"] = _platform()
    report["kernel_backend"] = ops.kernel_backend()
    for name in envs.environment_variables:
        setting: dict[str, Any] = {"name": name, "value": None, "default": name not in os.environ, "problem": None}
        try:
            setting["value"] = str(getattr(envs, name))
        except ValueError as exc:  # a malformed setting is a finding, not a crash
            setting["problem"] = str(exc)
            problem = problem or str(exc)
        report["settings"].append(setting)
    return problem


def environment_report() -> tuple[list[tuple[str, str]], str | None]:
    """``(label, value)`` lines, and the reason the plugin cannot run here (``None`` when it can)."""
    report = new_report()
    problem = environment(report)
    return environment_lines(report), problem


def environment_lines(report: dict[str, Any]) -> list[tuple[str, str]]:
    lines: list[tuple[str, str]] = []
    if report["vllm"] is not None:
        lines.append(("vLLM", report["vllm"]))
    if report["refused"] is not None:
        lines.append(("API generation", f"refused: {report['refused']}"))
    elif report["generation"] is not None:
        lines.append(("API generation", report["generation"]))
    lines.append(("platform", str(report["platform"])))
    lines.append(("kernel backend", str(report["kernel_backend"])))
    for setting in report["settings"]:
        value = setting["value"] if setting["problem"] is None else f"invalid: {setting['problem']}"
        lines.append((setting["name"], f"{value} (default)" if setting["default"] else value))
    return lines


def targets(platform: str) -> dict[str, Any]:
    """Every patch target of the detected generation on ``platform`` (vLLM's, and vllm-ascend's where it is
    installed), checked: ``{"generation", "platform", "verified", "total", "rows"}``."""
    import importlib.util

    from vllm_ascend_routing import manifest
    from vllm_ascend_routing.compat import get_api

    generation = get_api().generation
    packages = ["vllm"] + (["vllm_ascend"] if importlib.util.find_spec("vllm_ascend") is not None else [])
    findings = [finding for package in packages for finding in manifest.check(generation, platform, package)]
    rows = [
        {
            "target": finding.patch.target,
            "action": finding.patch.action,
            "present": finding.present,
            "problem": finding.problem,
        }
        for finding in findings
    ]
    verified = sum(1 for row in rows if row["problem"] is None)
    return {
        "generation": generation.value,
        "platform": platform,
        "verified": verified,
        "total": len(rows),
        "rows": rows,
        "counted": manifest.counted(findings),
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


def _platform() -> str:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "(vLLM not importable)"
    return str(current_platform.device_type)


def self_check(num_prompts: int, mode: str, dtype: str = "float32") -> dict[str, Any]:
    """Run the embedded tiny MoE through vLLM with the plugin in ``dtype``; every row must equal the float32
    reference, but for near-ties within ``dtype``'s rounding, which are counted (``compare.tie_tolerance``).
    ``{"ok", "detail", "parts", "near_ties", "capture", "capture_problems", ...}``: ``detail`` is the line
    printed (the summary, or every failure)."""
    os.environ["VLLM_ASCEND_ROUTING"] = "1"  # before the engine starts: the plugin loads with vLLM
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ASCEND_ROUTING_VALIDATE", "1")  # each returned array contract-checked too
    from vllm_ascend_routing.preflight import scenarios

    result = scenarios.run_offline(self_check_model(dtype), mode, num_prompts, dtype=dtype)
    capture, capture_problems = capture_report()
    validated, validation_problems = validation_report()
    capture, capture_problems = f"{capture}; {validated}", capture_problems + validation_problems
    return self_check_summary(
        {name: result[name] for name in PARTS}, capture, capture_problems, num_prompts, mode, dtype
    )


def self_check_summary(
    results: dict[str, dict[str, Any]],
    capture: str,
    capture_problems: list[str],
    num_prompts: int,
    mode: str,
    dtype: str,
) -> dict[str, Any]:
    """The self-check's verdict from each scenario's result (``matched``, ``rows``, ``near_ties``, ``ok``,
    ``problems``) and the capture counters."""
    parts: list[dict[str, Any]] = [
        {
            "name": name,
            "rows": int(part["rows"]),
            "matched": int(part["matched"]),
            "near_ties": int(part["near_ties"]),
            "ok": bool(part["ok"]),
            "problems": [str(problem) for problem in part["problems"]],
            "verdict": f"{part['matched']}/{part['rows']} rows exact",
        }
        for name, part in results.items()
    ]
    summary = ", ".join(f"{part['name']} {part['verdict']}" for part in parts)
    ties = sum(part["near_ties"] for part in parts)
    summary += f" ({ties} of them near-tie flips within {dtype} rounding)" if ties else ""
    failed = [f"{part['name']}: {'; '.join(part['problems']) or 'mismatch'}" for part in parts if not part["ok"]]
    failed += capture_problems
    return {
        "model": self_check_model(dtype),
        "prompts": num_prompts,
        "mode": mode,
        "dtype": dtype,
        "parts": parts,
        "near_ties": ties,
        "summary": summary,
        "capture": capture,
        "capture_problems": capture_problems,
        "ok": not failed,
        "detail": f"{summary}; {capture}" if not failed else "; ".join(failed),
    }


def self_check_model(dtype: str) -> str:
    """float32: the e2e suite's Qwen3-MoE; below it, the variant whose routing margins survive the dtype."""
    return "qwen3_moe" if dtype == "float32" else "qwen3_moe_robust"


def resolve_dtype(dtype: str) -> str:
    """``auto``: the platform's choice (``preflight.offline.platform_dtype``); anything else as given."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    from vllm_ascend_routing.preflight import offline

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


def _device_name(report: dict[str, Any]) -> None:
    """The device's name through torch, asked once the engine ran (asking before could initialise the device in
    this process before vLLM starts its workers)."""
    from vllm_ascend_routing import versions

    if report["versions"] is not None and report["versions"].get("device_name") is None:
        report["versions"]["device_name"] = versions.device_name()


def validation_report() -> tuple[str, list[str]]:
    """How many returned arrays validation mode checked in this process; a problem when it was on and checked
    none (its front-end hooks did not run: it would have passed anything)."""
    from vllm_ascend_routing import envs, validate

    mode, checked = envs.VLLM_ASCEND_ROUTING_VALIDATE, validate.checked_arrays()
    if mode == "off":
        return "validation mode off (VLLM_ASCEND_ROUTING_VALIDATE=0)", []
    problems = [] if checked else ["validation mode checked no returned array (its front-end hooks did not run)"]
    return f"validation mode ({mode}) checked {checked} returned arrays", problems


def _print(line: str) -> None:
    print(line, flush=True)


def _end(report: dict[str, Any], print_fn: Callable[[str], Any], stage: str, reason: str | None, text: str) -> int:
    """Print the verdict line, record it in ``report``; the exit status (0 only without a ``reason``)."""
    print_fn(VERDICT + text)
    status = 0 if reason is None else 1
    report["verdict"] = {"ok": reason is None, "stage": stage, "reason": reason, "text": text}
    report["exit_status"] = status
    return status


def _fail(report: dict[str, Any], print_fn: Callable[[str], Any], stage: str, reason: str) -> int:
    return _end(report, print_fn, stage, reason, f"FAIL: {reason}")


def run(
    num_prompts: int = 4,
    mode: str = "compiled",
    print_fn: Callable[[str], Any] = _print,
    surface: bool = False,
    platform: str | None = None,
    dtype: str = "auto",
    model: str | None = None,
    model_options: dict[str, Any] | None = None,
    report: dict[str, Any] | None = None,
) -> int:
    """The report, then the self-check in ``dtype`` (or, with ``model``, ``model_check`` on the user's model with
    ``model_options``: tensor_parallel_size, max_tokens, trust_remote_code, engine_flags); 0 on PASS, 1 on FAIL.
    ``report`` (a ``new_report()``), when given, is filled with what was printed, as data."""
    from vllm_ascend_routing import versions

    report = new_report() if report is None else report
    problem = environment(report)
    report["versions"] = versions.collect()  # after vLLM was imported (with torch: its CUDA version)
    plugin, *others = version_lines(report["versions"])
    found = environment_lines(report)
    after_vllm = 1 if report["vllm"] is not None else 0  # the other releases next to vLLM's
    lines = [plugin, *found[:after_vllm], *others, *found[after_vllm:]]
    width = max(len(label) for label, _ in lines)
    print_fn("vllm-ascend-routing doctor")
    for label, value in lines:
        print_fn(f"  {label:<{width}}  {value}")
    if problem is not None:
        return _fail(report, print_fn, "environment", problem)
    platform = report["platform"] = platform or _platform()
    if platform not in PLATFORMS:
        return _fail(
            report,
            print_fn,
            "platform",
            f"vLLM reports platform {platform!r}, which has no patch targets here; pass "
            f"--platform ({', '.join(PLATFORMS)}) to check a release this machine cannot run",
        )
    patches = report["patches"] = targets(platform)
    for line in target_lines(patches):
        print_fn(f"  {line}")
    missing = first_problem(patches)
    if missing is not None:
        return _fail(report, print_fn, "patches", missing)
    binder = report["binder"] = binder_coverage()
    coverage, uncovered = coverage_lines(binder)
    for line in coverage:
        print_fn(f"  {line}")
    if uncovered is not None:
        return _fail(report, print_fn, "binder", uncovered)
    if surface:
        verified = f"static: {patches['verified']}/{patches['total']} targets verified"
        return _end(report, print_fn, "surface", None, f"PASS ({verified})")
    if model is not None:
        from vllm_ascend_routing.preflight import model_check
        from vllm_ascend_routing.preflight.engine_flags import EngineFlagsError

        try:
            ok, detail, extra = model_check.run(
                model, print_fn, num_prompts, dtype=dtype, mode=mode, **(model_options or {})
            )
        except EngineFlagsError as exc:  # flags vLLM's parser refused (its message is on stderr): no engine
            return _fail(report, print_fn, "engine_flags", str(exc))
        report["model_check"] = {"model": model, "ok": ok, "detail": detail, **extra}
        _device_name(report)
        print_fn(f"  {detail}")
        if ok:
            return _end(report, print_fn, "model_check", None, "PASS")
        return _fail(report, print_fn, "model_check", detail)
    chosen = resolve_dtype(dtype)
    print_fn(
        f"self-check: tiny Qwen3-MoE ({self_check_model(chosen)}), {num_prompts} prompts, {mode}, {chosen}, "
        "against float32 transformers ..."
    )
    checked = report["self_check"] = self_check(num_prompts, mode, chosen)
    _device_name(report)
    print_fn(f"  {checked['detail']}")
    if checked["ok"]:
        return _end(report, print_fn, "self_check", None, "PASS")
    return _fail(report, print_fn, "self_check", checked["detail"])


def run_json(**options: Any) -> int:
    """``run(**options)`` with everything it and vLLM print (its workers included) sent to stderr, then the
    filled report as one JSON line on stdout: stdout holds nothing else for a tool to skip."""
    sys.stdout.flush()
    stdout = os.dup(1)
    # The file descriptor, for vLLM's C++ code and its worker processes, which inherit it; sys.stdout too, for
    # Python code holding another stream as sys.stdout (a test's capture).
    os.dup2(2, 1)
    report = new_report()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            status = run(report=report, **options)
    except BaseException as exc:  # a crash is a verdict too (exit status 1, as without --json)
        report["verdict"] = {"ok": False, "stage": "crash", "reason": f"{type(exc).__name__}: {exc}", "text": None}
        report["exit_status"] = 1
        raise
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
        print(json.dumps(report), flush=True)
    return status
