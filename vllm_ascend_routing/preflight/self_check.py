# SPDX-License-Identifier: Apache-2.0
"""doctor's self-check: vLLM with the plugin on the embedded tiny MoE, every row against the float32 reference.

Runs the offline scenario (``preflight.scenarios``: a batch, a chunked prefill and its prefix-cached repeat) in the
platform's dtype (``--dtype``: float32 on the CPU, bfloat16 or float16 on GPUs and NPUs), then vLLM's weight reload
on the same engine (``preflight.weight_reload``: the rows after ``reload_weights``, as after an RL weight sync);
near-tie flips within that dtype's rounding are counted (``compare.tie_tolerance``), then the capture's and
validation mode's counters.
"""

from __future__ import annotations

from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
PARTS = ("batch", "chunked_prefill", "prefix_repeat")  # the offline scenario's parts, in the order printed
RELOAD = "after_reload"  # then the weight reload's part


def run(num_prompts: int, mode: str, dtype: str = "float32") -> dict[str, Any]:
    """Run the embedded tiny MoE through vLLM with the plugin in ``dtype``; every row must equal the float32
    reference, but for near-ties within ``dtype``'s rounding, which are counted (``compare.tie_tolerance``).
    ``{"ok", "detail", "parts", "near_ties", "capture", "capture_problems", ...}``: ``detail`` is the line
    printed (the summary, or every failure). The caller (doctor) set the plugin's variables and the engine's."""
    from vllm_ascend_routing.preflight import scenarios, weight_reload

    arch = model_for(dtype)
    result = scenarios.run_offline(
        arch, mode, num_prompts, dtype=dtype, after=lambda llm: {RELOAD: weight_reload.check(llm, arch, dtype)}
    )
    capture, capture_problems = capture_report(result.get("sentinel"))
    validated, validation_problems = validation_report()
    capture, capture_problems = f"{capture}; {validated}", capture_problems + validation_problems
    parts = {name: result[name] for name in PARTS}
    reload = weight_reload.self_check_part(result[RELOAD])
    if reload is not None:
        parts[RELOAD] = reload
    else:
        capture += f"; {RELOAD} not checked: {result[RELOAD]['not_run']}"
    return summary(parts, capture, capture_problems, num_prompts, mode, dtype)


def summary(
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
            "verdict": f"{part['matched']}/{part['rows']} rows exact{part.get('note', '')}",
        }
        for name, part in results.items()
    ]
    text = ", ".join(f"{part['name']} {part['verdict']}" for part in parts)
    ties = sum(part["near_ties"] for part in parts)
    text += f" ({ties} of them near-tie flips within {dtype} rounding)" if ties else ""
    failed = [f"{part['name']}: {'; '.join(part['problems']) or 'mismatch'}" for part in parts if not part["ok"]]
    failed += capture_problems
    return {
        "model": model_for(dtype),
        "prompts": num_prompts,
        "mode": mode,
        "dtype": dtype,
        "parts": parts,
        "near_ties": ties,
        "summary": text,
        "capture": capture,
        "capture_problems": capture_problems,
        "ok": not failed,
        "detail": f"{text}; {capture}" if not failed else "; ".join(failed),
    }


def model_for(dtype: str) -> str:
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


def capture_report(totals: dict[str, int] | None = None) -> tuple[str, list[str]]:
    """What the always-on check (``sentinel``) counted over the run: rows checked, all-zero rows of bound MoE
    layers, invalid ids (stored as -1). ``totals``: the workers' counters (``offline.sentinel_totals``), else this
    process's; the layers bound where the runners are in this process. Counting no row is a problem: the check
    did not run, or its counters did not come back."""
    from vllm_ascend_routing import runner_state, sentinel

    captures = runner_state.captures_in_process()
    seen = totals if totals is not None else sentinel.stats().as_dict()
    bound = f"{sum(capture.num_bound_layers for capture in captures)} MoE layers bound; " if captures else ""
    rows, steps = seen.get("rows_checked", 0), seen.get("steps_checked", 0)
    if not rows:
        return f"{bound}always-on check: no row counted", ["the always-on check counted no row (did it run?)"]
    zero, invalid = seen.get("zero_rows", 0), seen.get("invalid_ids", 0)
    problems = []
    if zero:
        problems.append(f"{zero} all-zero routing rows (a MoE layer's capture bypassed)")
    if invalid:
        problems.append(f"{invalid} out-of-range expert ids recorded (stored as -1)")
    return f"{bound}always-on check: {rows} rows in {steps} steps, {zero} all-zero, {invalid} invalid ids", problems


def validation_report() -> tuple[str, list[str]]:
    """How many returned arrays validation mode checked in this process; a problem when it was on and checked
    none (its front-end hooks did not run: it would have passed anything)."""
    from vllm_ascend_routing import envs, validate

    mode, checked = envs.VLLM_ASCEND_ROUTING_VALIDATE, validate.checked_arrays()
    if mode == "off":
        return "validation mode off (VLLM_ASCEND_ROUTING_VALIDATE=0)", []
    problems = [] if checked else ["validation mode checked no returned array (its front-end hooks did not run)"]
    return f"validation mode ({mode}) checked {checked} returned arrays", problems
