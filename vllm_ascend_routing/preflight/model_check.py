# SPDX-License-Identifier: Apache-2.0
"""``doctor --model PATH [-- ENGINE FLAGS]``: the plugin on the user's own model and layout, every check switched on.

The engine is built from the flags the user runs ``vllm serve`` with (``preflight.engine_flags``: vLLM's own
parser; ``--tensor-parallel-size`` of doctor itself still works). No reference exists for an arbitrary model, so
this proves what can be proven without one: vLLM with the plugin starts on that layout, every returned array
passes strict validation (shape ``[prompt + output - 1, num_hidden_layers, top_k]``, vLLM's dtype, ids in
range), the always-on check sees no all-zero row of a bound MoE layer and no invalid id on any worker (where the
workers' counters can be fetched), and the re-prefill consistency oracle (``preflight.reprefill``,
``preflight.consistency``) finds every generation row equal to the same token's row of an independent re-prefill,
per layer, naming the structural fault where not. Prints, per hidden layer, the rows returned, the all-zero rows
and how many distinct experts were routed to, then the oracle's per-layer table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_ascend_routing import contract

PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):",
    "Translate to French: the weather is nice today.",
    "A mixture-of-experts model routes each token to",
    "In 1905, Albert Einstein published",
    "The three primary colors are",
    "Question: what is 17 times 23? Answer:",
    "Once upon a time in a small village,",
)
CPU_KV_CACHE_BYTES = 512 * 1024 * 1024


@dataclass
class LayerRows:
    rows: int = 0
    zero_rows: int = 0
    experts: set[int] = field(default_factory=set)


def run(
    path: str,
    print_fn: Callable[[str], Any],
    num_prompts: int = 4,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    max_tokens: int = 16,
    mode: str = "compiled",
    trust_remote_code: bool = False,
    engine_flags: list[str] | None = None,
) -> tuple[bool, str, dict[str, Any]]:
    """Start vLLM with the plugin on ``path`` with ``engine_flags``, generate, check, run the oracle;
    ``(ok, one-line summary or the problems, {"engine_flags", "engine_options", "consistency", "workload"})``."""
    os.environ["VLLM_ASCEND_ROUTING"] = "1"
    os.environ["VLLM_ASCEND_ROUTING_VALIDATE"] = "strict"  # a contract violation raises, naming the request
    from vllm import SamplingParams

    from vllm_ascend_routing.preflight import engine_flags as flags_module
    from vllm_ascend_routing.preflight import frontend, offline

    flags = list(engine_flags or [])
    given = flags_module.parse(path, flags)
    extra: dict[str, Any] = {"engine_flags": flags, "engine_options": sorted(set(given) - {"model"})}
    # The workers' always-on counters come back through collective_rpc with a function (this process only).
    wanted = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    data_parallel = int(given.get("data_parallel_size", 1) or 1)
    if data_parallel <= 1:
        wanted["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    own = {
        "tensor_parallel_size": tensor_parallel_size,
        "dtype": offline.platform_dtype() if dtype == "auto" else dtype,
        "enforce_eager": mode == "eager",
        "trust_remote_code": trust_remote_code,
    }
    for name, value in own.items():  # doctor's own options, where the engine flags do not set them
        given.setdefault(name, value)
    if given["tensor_parallel_size"] != tensor_parallel_size and tensor_parallel_size != 1:
        raise flags_module.EngineFlagsError(
            f"--tensor-parallel-size {tensor_parallel_size} and, after --, {given['tensor_parallel_size']}: give one"
        )
    options = flags_module.preflight_options(given, offline.on_cpu(), CPU_KV_CACHE_BYTES)
    if offline.on_cpu():  # what the self-check knows about the CPU build: a NUMA node per rank, or explicit cores
        local_data_parallel = int(given.get("data_parallel_size_local") or data_parallel)
        binding = offline.cpu_thread_binding(int(options["tensor_parallel_size"]) * local_data_parallel)
        if binding is not None:
            wanted["VLLM_CPU_OMP_THREADS_BIND"] = binding
    extra["engine_env"] = offline.set_engine_env(wanted)
    print_fn(
        f"model check: {path}, TP {options['tensor_parallel_size']}, DP {options.get('data_parallel_size', 1)}, "
        f"{options['dtype']}, "
        f"{'eager' if options['enforce_eager'] else 'compiled'}, {num_prompts} prompts; engine flags: "
        f"{' '.join(flags) or '(none)'}"
    )
    print_fn(f"  {offline.engine_env_line(extra['engine_env'])}")
    engine = frontend.open_engine(options)
    try:
        return _check(engine, options, extra, num_prompts, max_tokens, print_fn, SamplingParams)
    finally:
        engine.close()


def _check(
    engine: Any,
    options: dict[str, Any],
    extra: dict[str, Any],
    num_prompts: int,
    max_tokens: int,
    print_fn: Callable[[str], Any],
    sampling_params: Any,
) -> tuple[bool, str, dict[str, Any]]:
    from vllm_ascend_routing.preflight import reprefill

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_prompts)]
    params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = engine.generate(prompts, [params] * len(prompts))
    model_config = engine.model_config
    num_layers = int(model_config.get_total_num_hidden_layers())

    def rows(output: Any) -> Any:  # from token 0, every decoder layer (vLLM 0.21.0: its two arrays joined)
        return contract.request_rows(output, model_config.hf_text_config, num_layers)

    problems = plausibility(outputs, num_layers, print_fn, rows, known_moe_layers(model_config.hf_text_config))
    totals = engine.sentinel_totals()
    if totals is None:  # engine cores in processes of their own (DP): strict validation still ran on every array
        checked = "always-on check: counters not fetched from the DP engine cores (they log what they find)"
    else:
        checked = f"always-on check: {totals.get('rows_checked', 0)} rows in {totals.get('steps_checked', 0)} steps"
        if totals.get("zero_rows", 0):
            problems.append(f"{totals['zero_rows']} all-zero rows of bound MoE layers (a capture bypassed)")
        if totals.get("invalid_ids", 0):
            problems.append(f"{totals['invalid_ids']} out-of-range expert ids (stored as -1)")
        if not totals.get("rows_checked", 0):
            problems.append("the always-on check saw no row (the workers' counters did not come back)")

    layout = reprefill.Layout.of(engine.vllm_config)  # the workload scales to the engine as vLLM resolved it
    result, work = reprefill.run(
        engine.generate,
        lambda n: sampling_params(temperature=0.0, max_tokens=n, ignore_eos=True),
        layout,
        int(model_config.get_vocab_size()),
        max_tokens,
        str(model_config.dtype).removeprefix("torch."),  # as resolved (a flag's "auto": the model's)
        rows,
    )
    print_fn(
        f"  re-prefill oracle: {work.requests} requests ({work.concurrent} at once, max_num_seqs "
        f"{layout.max_num_seqs}), {work.prompt_tokens} prompt tokens (longest {work.longest_prompt}, step budget "
        f"{layout.max_num_batched_tokens}: {work.chunked_prefills} chunked prefills), {work.generated_tokens} "
        f"generated, {work.cached_tokens} served from the prefix cache (blocks of {layout.block_size})"
    )
    for note in work.notes:
        print_fn(f"  note: {note}")
    for line in result.table():
        print_fn(line)
    print_fn(f"  {result.summary()}")
    extra.update(consistency=result.as_dict(), workload=vars(work))
    problems += work.problems
    if not result.ok:
        problems.append(result.summary())
    if problems:
        return False, "; ".join(problems), extra
    moe = f"{len(result.layers)}/{num_layers} layers with routing"
    return True, f"{len(outputs)} requests, {moe}, strict validation passed; {checked}; {result.summary()}", extra


def known_moe_layers(hf_config: Any) -> tuple[int, ...] | None:
    """The layers with a router, as vLLM builds the model (``contract.moe_layers``); ``None`` for a config of no
    family the plugin can read."""
    try:
        return contract.moe_layers(hf_config)
    except contract.UnknownMoELayersError:
        return None


def layer_kind(layer: int, moe_layers: tuple[int, ...] | None) -> str:
    if moe_layers is None:
        return "(config of an unknown family)"
    return "MoE" if layer in moe_layers else "dense: no router, all zero by design"


def plausibility(
    outputs: list[Any],
    num_layers: int,
    print_fn: Callable[[str], Any],
    rows: Callable[[Any], Any],
    moe_layers: tuple[int, ...] | None = None,
) -> list[str]:
    """Shape, all-zero rows and experts routed to, per layer (printed, each layer labelled MoE or dense where the
    config says: a dense layer's rows are all zero by design, a MoE layer's never); the problems found.
    ``rows(output)``: the request's rows from token 0 on the decoder-layer axis (``contract.request_rows``)."""
    layers = [LayerRows() for _ in range(num_layers)]
    problems: list[str] = []
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        routed = rows(output)
        tokens = len(output.prompt_token_ids) + len(completion.token_ids) - 1  # the last token is never forwarded
        if routed is None:
            problems.append(f"request {index}: routed_experts is None")
            continue
        array = np.asarray(routed)
        if array.ndim != 3 or array.shape[0] != tokens or array.shape[1] != num_layers:
            problems.append(f"request {index}: shape {array.shape}, expected ({tokens}, {num_layers}, top_k)")
            continue
        for layer, layer_rows in enumerate(array.transpose(1, 0, 2)):
            layers[layer].rows += len(layer_rows)
            layers[layer].zero_rows += int(np.all(layer_rows == 0, axis=-1).sum())
            layers[layer].experts.update(int(e) for e in np.unique(layer_rows))
    print_fn("  layer    rows  all-zero  experts routed to  layer type")
    for layer, seen in enumerate(layers):
        kind = layer_kind(layer, moe_layers)
        print_fn(f"  {layer:5d}  {seen.rows:6d}  {seen.zero_rows:8d}  {len(seen.experts):17d}  {kind}")
    if not any(seen.experts - {0} for seen in layers):
        problems.append("no layer routed to any expert but 0")
    return problems
