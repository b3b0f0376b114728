# SPDX-License-Identifier: Apache-2.0
"""``doctor --model PATH -- ENGINE FLAGS``: the flags the user runs ``vllm serve`` with, read by vLLM's own parser.

vLLM's ``FlexibleArgumentParser`` with ``AsyncEngineArgs.add_cli_args`` (the engine arguments ``vllm serve``
accepts: ``--data-parallel-size``, ``--enable-expert-parallel``, ``--quantization``, ``--additional-config``,
``--compilation-config``, ``--async-scheduling``, ``--speculative-config``, ...), then
``EngineArgs.from_cli_args``: every flag means what it means to vLLM, and one vLLM does not know is refused by
it. What the user gave (each field that differs from ``EngineArgs``' default) is returned as keyword arguments;
the pre-flight adds only what it needs and the user did not set (``preflight_options``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Options the pre-flight needs; the user's flags win over each but the first (without it there is nothing to check).
FORCED = {"enable_return_routed_experts": True}
# Its defaults where the user's flags say nothing: a short context (the workload's prompts are short), chunked
# prefill with a small step (long prompts then take several steps), a small batch (the workload fills it:
# max_num_seqs + 2 requests), prefix caching on (its hits are part of the workload; vLLM 0.31+ return routed
# experts only with it), reproducible sampling. Give yours after -- and the workload scales to them.
DEFAULTS: dict[str, Any] = {
    "max_model_len": 1024,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
    "enable_prefix_caching": True,
    "seed": 0,
}


class EngineFlagsError(ValueError):
    """The flags after ``--`` are not what vLLM's parser accepts (its own message, and the flag)."""


def parser() -> Any:
    """vLLM's ``vllm serve`` engine-argument parser."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # where vLLM keeps it in vllm.utils itself
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="doctor --model PATH --", add_help=False))


def parse(model: str, flags: list[str]) -> dict[str, Any]:
    """The engine options ``flags`` set for ``model``: ``{field: value}`` of each ``EngineArgs`` field whose value
    differs from what the parser gives without them (its defaults are not always the dataclass's), ``model``
    included. Raises ``EngineFlagsError`` with vLLM's message."""
    from vllm.engine.arg_utils import EngineArgs

    if "--model" in flags or any(flag.startswith("--model=") for flag in flags):
        raise EngineFlagsError("give the model as doctor --model PATH, not after --")
    given, baseline = (EngineArgs.from_cli_args(_parse(["--model", model, *words])) for words in (flags, []))
    return {
        item.name: getattr(given, item.name)
        for item in dataclasses.fields(EngineArgs)
        if item.name == "model" or _differs(getattr(given, item.name), getattr(baseline, item.name))
    }


def _parse(words: list[str]) -> Any:
    try:
        return parser().parse_args(words)
    except SystemExit as exc:  # argparse exits on an unknown or malformed flag, after printing why (stderr)
        raise EngineFlagsError(f"vLLM's engine-argument parser refused: {' '.join(words[2:])}") from exc


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:  # a config object without equality: the user gave it
        return True


def preflight_options(given: dict[str, Any], on_cpu: bool, cpu_kv_cache_bytes: int) -> dict[str, Any]:
    """``LLM`` keyword arguments: the user's options, the pre-flight's defaults where they said nothing, routed
    experts on; on the CPU a fixed KV cache unless they sized one."""
    options = {**DEFAULTS, **given, **FORCED}
    if on_cpu and "kv_cache_memory_bytes" not in given:
        options["kv_cache_memory_bytes"] = cpu_kv_cache_bytes
    return options
