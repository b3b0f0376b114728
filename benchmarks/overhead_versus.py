# SPDX-License-Identifier: Apache-2.0
"""``make bench VERSUS=1`` (``overhead.py --versus-vllm``): the plugin against vLLM's own capture, eager and/or
compiled, every order of the engines in turn, with the A/A control; per-round ratios and their medians."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import history
from overhead_engine import (
    ARCH,
    Engine,
    engine_method,
    machine,
    prime_compile_cache,
    vllm_capture_records_on_cpu,
)
from overhead_report import ratio_text


def versus_vllm(args: argparse.Namespace) -> None:
    """Plugin against vLLM's own capture, eager and/or compiled, alternating rounds, with the A/A control."""
    import vllm

    if not vllm_capture_records_on_cpu():
        raise SystemExit(
            f"--versus-vllm: vLLM {vllm.__version__}'s own routed-experts capture does not record on "
            "the CPU build (only 0.30's does): run it with RELEASE=0.30.0"
        )
    settings = ["eager", "compiled"] if args.compilation == "both" else [args.compilation]
    modes = ["vllm", "plugin"] + (["vllm-control"] if args.control else [])
    print(
        f"vLLM {vllm.__version__}: plugin vs vLLM's own capture ({', '.join(settings)}), {engine_method(args)}, "
        f"{args.pairs} rounds of {' / '.join(modes)} (each order of the modes in turn), "
        f"{args.requests} requests x {args.tokens} tokens, {ARCH}",
        flush=True,
    )
    summary: dict[str, Any] = {
        "vllm": vllm.__version__,
        "machine": machine(),
        "workload": {
            "model": ARCH,
            "requests": args.requests,
            "tokens": args.tokens,
            "engine": engine_method(args),
        },
        "settings": {},
    }
    # Every order of the modes in turn (6 for three modes): each mode runs first, middle and last equally often,
    # so a position effect (the engine that runs right after another, or right after start) cancels.
    orders = list(itertools.permutations(modes))
    for setting in settings:
        runs: list[dict[str, Any]] = []
        print(f"== {setting}", flush=True)
        with tempfile.TemporaryDirectory(prefix="overhead_cache_") as cache_root:
            engines: dict[str, Engine] = {}
            if setting == "compiled":
                prime_compile_cache(modes, args, cache_root)
            try:
                for round_index in range(args.pairs):
                    order = orders[round_index % len(orders)]
                    if args.fresh_engines or not engines:  # fresh: new processes every round, started in order
                        for started in engines.values():
                            started.close()
                        engines = {mode: Engine(mode, args, cache_root, eager=setting == "eager") for mode in order}
                    for mode in order:
                        run = engines[mode].run()
                        runs.append(run)
                        print(
                            f"  round {round_index + 1} {mode:12s} {run['tokens_per_s']:9.1f} tokens/s "
                            f"({run['seconds']:.2f} s, {run['tokens_per_cpu_s']:.1f} tokens/CPU-s)",
                            flush=True,
                        )
            finally:
                for started in engines.values():
                    started.close()
        by_mode = {m: [r for r in runs if r["mode"] == m] for m in modes}
        setting_summary: dict[str, Any] = {"runs": runs}
        for mode in modes[1:]:
            for key, label in (("tokens_per_s", "throughput"), ("tokens_per_cpu_s", "tokens-per-CPU-second")):
                ratios = [b[key] / a[key] for a, b in zip(by_mode["vllm"], by_mode[mode], strict=True)]
                setting_summary[f"{mode}/vllm {label}"] = {"median": statistics.median(ratios), "rounds": ratios}
                print(f"  {setting} {label} ratio {mode}/vllm: {ratio_text(ratios)}", flush=True)
        for mode in modes[1:]:
            # Where a throughput difference comes from: the full batch's decode steps, forward and the rest.
            for part in ("forward_us", "rest_us"):
                pairs = [
                    (a["decode_step"][part], b["decode_step"][part])
                    for a, b in zip(by_mode["vllm"], by_mode[mode], strict=True)
                    if a["decode_step"]["steps"] and b["decode_step"]["steps"]
                ]
                if not pairs:
                    continue
                ratios = [b / a for a, b in pairs]
                base_us, mode_us = (statistics.median(column) for column in zip(*pairs, strict=True))
                setting_summary[f"{mode}/vllm decode-step {part}"] = {
                    "median": statistics.median(ratios),
                    "rounds": ratios,
                    "us": {"vllm": base_us, mode: mode_us},
                }
                print(
                    f"  {setting} decode step, {part[:-3]}, {mode}/vllm: {ratio_text(ratios)}; "
                    f"{mode_us:.0f} vs {base_us:.0f} us",
                    flush=True,
                )
        summary["settings"][setting] = setting_summary
    out = args.out or Path(__file__).parent / "results" / f"versus-vllm-{vllm.__version__}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    if args.out is None:  # a run written elsewhere is someone's experiment, not the record
        history.record("versus", summary)
