#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The engine checks' plan (which engines, in which order, with which kernel) and its dry run on vLLM's CPU build.

    python scripts/gpu_e2e/engine_checks.py --cpu [--only eager_f32,bench] [--parallel 1] [--out DIR]

On the GPU machine ``device_run.py`` (``make gpu-e2e``) runs this plan: the cases of ``cases.py`` each in an engine
process of its own, several at once (tiny models, a fixed small KV cache each), a timeout per engine and a deadline
for all; the cases marked ``native`` wait for the CUDA kernel's build and run on it, the others on Triton's kernel;
the benchmark's engines start with the others and time their batches once every other engine is done.

``--cpu`` (with the 0.26.0 environment's python: ``scripts/venv.py 0.26.0 --print``) runs the same plan on the vLLM CPU
build of this venv, without the cases that need a GPU (``cases.GPU_ONLY``), one engine at a time by default: what
fails here fails there too, before a GPU's minutes are spent on it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import cases  # noqa: E402
from jobs import Job, Outcome, run_jobs  # noqa: E402

ENGINE_TIMEOUT_S = {False: 300.0, True: 1800.0}  # per engine: GPU, CPU build
BENCH_TIMEOUT_S = {False: 420.0, True: 2400.0}
QUIET_FILE = "others-done"  # appears in the log folder once every engine but the benchmark's has ended


def selected(cpu: bool, only: list[str] | None) -> list[str]:
    """The cases to run: ``only``'s (any known case), else every case but those run on request."""
    names = [name for name in (cases.KNOWN_CASES if only else cases.ALL_CASES) if not (cpu and name in cases.GPU_ONLY)]
    if only:
        unknown = sorted(set(only) - set(cases.KNOWN_CASES))
        if unknown:
            raise SystemExit(f"unknown cases {unknown}; choose from {', '.join(cases.KNOWN_CASES)}")
        names = [name for name in names if name in only]
    return names


def plan(
    names: list[str],
    cpu: bool,
    log_dir: Path,
    env: dict[str, str],
    native: tuple[Path, dict[str, str]] | None = None,
    build: str | None = None,
) -> list[Job]:
    """One job per case. ``native``: the checkout copy with the CUDA kernel built into it and its environment; the
    cases marked ``native`` run from that copy, after the job ``build`` (skipped if it failed)."""
    jobs = []
    for name in names:
        on_native = native is not None and name in cases.CASES and cases.CASES[name].native
        root, case_env = native if native is not None and on_native else (ROOT, env)
        command = [sys.executable, str(root / "scripts" / "gpu_e2e" / "cases.py"), name, *(["--cpu"] if cpu else [])]
        extra = {"GPU_E2E_LOG_DIR": str(log_dir), "GPU_E2E_QUIET": str(log_dir / QUIET_FILE)}
        timeout = BENCH_TIMEOUT_S[cpu] if name == cases.BENCH_CASE else ENGINE_TIMEOUT_S[cpu]
        after = (build,) if on_native and build else ()
        jobs.append(Job(name, command, {**case_env, **extra}, timeout, after, needs_ok=True))
    return jobs


def announce_quiet(log_dir: Path, jobs: list[Job]) -> None:
    """Make the quiet file appear once every job but the benchmark's has ended (a job of its own: the scheduler
    starts it when they have)."""
    others = tuple(job.name for job in jobs if job.name != cases.BENCH_CASE)
    jobs.append(Job("quiet", ["touch", str(log_dir / QUIET_FILE)], timeout_s=10, after=others, engine=False))


def build_models(names: list[str], python: str, env: dict[str, str]) -> str:
    """Every tiny model the cases use, built once before any engine starts (engines building one concurrently would
    race on its folder)."""
    archs = sorted({cases.CASES[name].arch for name in names if name in cases.CASES})
    if cases.SPEC_CASE in names:
        archs.append("qwen3_moe")
    if cases.BENCH_CASE in names:
        archs += [cases.bench_workload(True)[0], cases.bench_workload(False)[0]]
    archs = sorted(set(archs))
    code = (
        "import sys; import tests.harness.model_recipes; from vllm_ascend_routing.preflight import models, scenarios\n"
        "for arch in sys.argv[1:]: models.build_tiny_moe(arch, scenarios.model_dir() / arch)"
    )
    done = subprocess.run([python, "-c", code, *archs], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny models failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return ", ".join(archs)


def oracle_cell(consistency: dict[str, Any] | None) -> str:
    """The re-prefill oracle's verdict and, per MoE layer, its near-ties over the rows it compared."""
    if not consistency:
        return "-"
    layers = ", ".join(f"L{layer['layer']} {layer['near_ties']}/{layer['rows']}" for layer in consistency["layers"])
    return f"{consistency['verdict']} (near-ties {layers})"


def table(outcomes: dict[str, Outcome]) -> list[str]:
    """One line per case: status, rows exact / total over its parts, the oracle's verdict, the always-on check."""
    header = "| check | configuration | result | rows exact / total | re-prefill oracle |"
    lines = [header + " always-on check (rows, zero, invalid) |"]
    lines.append("|---|---|---|---|---|---|")
    for name, outcome in outcomes.items():
        result = outcome.result or {}
        parts = [v for v in result.values() if isinstance(v, dict) and "rows" in v and "matched" in v]
        rows = f"{sum(p['matched'] for p in parts)} / {sum(p['rows'] for p in parts)}" if parts else "-"
        oracle = oracle_cell(result.get("oracle", {}).get("consistency"))
        sentinel = result.get("sentinel")
        check = (
            "-" if not sentinel else f"{sentinel['rows_checked']}, {sentinel['zero_rows']}, {sentinel['invalid_ids']}"
        )
        if name == cases.BENCH_CASE and "median_tokens_per_s" in result:
            rows = "tokens/s " + ", ".join(f"{m} {v:.0f}" for m, v in result["median_tokens_per_s"].items())
            oracle = f"plugin/off {result['plugin_over_off']:.3f}, plugin/vLLM {result['plugin_over_vllm']:.3f}"
        status = outcome.status if not result.get("failures") else f"{outcome.status}: {'; '.join(result['failures'])}"
        lines.append(f"| {name} | {result.get('what', '')} | {status} | {rows} | {oracle} | {check} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cpu", action="store_true", required=True, help="vLLM's CPU build (GPU runs: device_run.py)")
    parser.add_argument("--only", default="", help=f"comma-separated cases of {', '.join(cases.KNOWN_CASES)}")
    parser.add_argument("--parallel", type=int, default=1, help="engines at a time")
    parser.add_argument("--deadline", type=float, default=4 * 3600, help="seconds for all of them")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-e2e-cpu")
    args = parser.parse_args(argv)
    names = selected(True, [n for n in args.only.split(",") if n] or None)
    args.out = args.out.resolve()  # engines (and the compilers they start) run in other folders
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / QUIET_FILE).unlink(missing_ok=True)
    # A fresh compile cache per dry run: vLLM 0.26.0's CPU MoE op finds its layer by the Python id() baked into the
    # compiled code, so a graph loaded from an earlier process's cache looks up a layer that is not there (KeyError).
    cache = args.out / "vllm-cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {"PYTHONPATH": str(ROOT), "VLLM_ASCEND_ROUTING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    env["VLLM_CACHE_ROOT"] = str(cache)
    started = time.monotonic()
    print(f"engine checks (CPU dry run): {', '.join(names)}; models: {build_models(names, sys.executable, env)}")
    jobs = plan(names, True, log_dir, env)
    announce_quiet(log_dir, jobs)
    outcomes = run_jobs(jobs, log_dir, started + args.deadline, args.parallel)
    outcomes.pop("quiet", None)
    summary: dict[str, Any] = {"cpu": True, "seconds": round(time.monotonic() - started), "cases": {}}
    summary["cases"] = {name: outcome.as_dict() for name, outcome in outcomes.items()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print("\n".join(table(outcomes)))
    passed = all(o.status == "passed" for o in outcomes.values())
    print(f"engine checks (CPU dry run): {'PASSED' if passed else 'FAILED'} in {summary['seconds']} s; {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
