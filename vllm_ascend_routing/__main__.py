# SPDX-License-Identifier: Apache-2.0
"""Command line: ``python -m vllm_ascend_routing demo`` / ``doctor`` / ``replay-check`` / ``--version``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def demo(arch: str, prompts: int, mode: str) -> int:
    """Run vLLM with the plugin on a tiny MoE; print shapes, the match rate and the expert load."""
    os.environ["VLLM_ASCEND_ROUTING"] = "1"  # before vLLM is imported: the plugin loads with it
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm_ascend_routing.preflight import models, scenarios

    result = scenarios.run_offline(arch, mode, prompts)
    info = models.build_tiny_moe(arch, scenarios.model_dir() / arch)
    batch = result["batch"]
    print(
        f"\nvllm-ascend-routing demo: {arch} ({info.num_hidden_layers} layers, {info.num_experts} experts, "
        f"top-{info.top_k}), {mode} mode, {len(batch['arrays'])} prompts of mixed length\n"
    )
    print("request  prompt+gen-1 rows  routed_experts shape  dtype")
    for i, array in enumerate(batch["arrays"]):
        print(f"{i:7d}  {array['shape'][0]:17d}  {str(tuple(array['shape'])):20s}  {array['dtype']}")
    print()
    for name in ("batch", "chunked_prefill", "prefix_repeat"):
        part = result[name]
        print(
            f"{name:16s} match vs transformers reference: {part['matched']}/{part['rows']} (token, MoE layer) "
            f"rows = {100.0 * part['matched'] / max(part['rows'], 1):.2f}%"
        )
    print("\nexpert load (batch): tokens routed to each expert, per MoE layer")
    print_load(result["load_table"])
    ok = all(result[name]["ok"] for name in ("batch", "chunked_prefill", "prefix_repeat"))
    print("\nRESULT:", "PASS (every row exact)" if ok else "FAIL " + "; ".join(result["batch"]["problems"]))
    return 0 if ok else 1


def print_load(table: dict[str, Any]) -> None:
    num_experts = len(next(iter(table.values())))
    print("layer " + "".join(f"{f'e{e}':>6s}" for e in range(num_experts)))
    for layer, counts in table.items():
        print(f"{layer:>5s} " + "".join(f"{c:6d}" for c in counts))


class VersionAction(argparse.Action):
    """``--version``: the line is computed only when asked for (it may run ``git``), then the program exits."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version (and commit) and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from vllm_ascend_routing import versions

        print(versions.version_line())
        parser.exit()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_ascend_routing")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("demo", help="exact routed experts on an embedded tiny MoE, checked against transformers")
    run.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "mixtral", "qwen3_moe_dense"])
    run.add_argument("--prompts", type=int, default=8)
    run.add_argument("--mode", default="compiled", choices=["eager", "compiled"])
    check = sub.add_parser(
        "doctor",
        help="versions, generation, platform, kernel, settings, patch targets; then a self-check (or --model: the "
        "pre-flight); the last line is the verdict: PASS, or FAIL (<kind>): <reason>. Next: <step>",
    )
    check.add_argument("--prompts", type=int, default=4)
    check.add_argument("--mode", default="compiled", choices=["eager", "compiled"])
    check.add_argument(
        "--surface",
        action="store_true",
        help="only check the patch targets against the installed source (no engine is started)",
    )
    check.add_argument(
        "--platform",
        choices=["cuda", "cpu", "npu"],
        help="check the targets of this platform (default: vLLM's current platform)",
    )
    check.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the self-check engine's dtype (auto: float32 on the CPU, else bfloat16 where supported, else float16)",
    )
    check.add_argument(
        "--model",
        help="check the plugin on this model (a path or name vLLM loads) instead, with the re-prefill consistency "
        "oracle; any `vllm serve` engine flag may follow a `--` (doctor --model PATH -- --data-parallel-size 2 ...)",
    )
    check.add_argument("--tensor-parallel-size", type=int, default=1, help="with --model: vLLM's TP size")
    check.add_argument("--max-tokens", type=int, default=16, help="with --model: tokens generated per prompt")
    check.add_argument("--trust-remote-code", action="store_true", help="with --model: passed to vLLM")
    check.add_argument(
        "--json",
        action="store_true",
        help="print the report as one JSON document on stdout (its first key, schema, versions it; the text to stderr)",
    )
    replay = sub.add_parser(
        "replay-check",
        help="vLLM's rows replayed in a transformers trainer: routing agreement "
        "and log-prob mismatch, natural vs replayed routing",
    )
    replay.add_argument("--arch", default="qwen3_moe_dense", choices=["qwen3_moe", "mixtral", "qwen3_moe_dense"])
    replay.add_argument("--prompts", type=int, default=8)
    replay.add_argument("--max-tokens", type=int, default=32)
    replay.add_argument("--mode", default="compiled", choices=["eager", "compiled"])
    replay.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="the trainer's precision (vLLM runs float32)",
    )
    argv = sys.argv[1:]
    # doctor --model PATH -- ENGINE FLAGS: what follows the first "--" is vLLM's (preflight.engine_flags)
    engine_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if engine_flags and (args.command != "doctor" or args.model is None):
        parser.error("engine flags after -- are for doctor --model PATH only")
    if args.command == "replay-check":
        from vllm_ascend_routing.preflight import replay_check

        sys.exit(replay_check.run(args.arch, args.prompts, args.max_tokens, args.mode, args.dtype))
    if args.command == "doctor":
        from vllm_ascend_routing.preflight import doctor

        options = {
            "tensor_parallel_size": args.tensor_parallel_size,
            "max_tokens": args.max_tokens,
            "trust_remote_code": args.trust_remote_code,
            "engine_flags": engine_flags,
        }
        checks: dict[str, Any] = {
            "num_prompts": args.prompts,
            "mode": args.mode,
            "surface": args.surface,
            "platform": args.platform,
            "dtype": args.dtype,
            "model": args.model,
            "model_options": options,
        }
        sys.exit(doctor.run_json(**checks) if args.json else doctor.run(**checks))
    sys.exit(demo(args.arch, args.prompts, args.mode))


if __name__ == "__main__":
    main()
