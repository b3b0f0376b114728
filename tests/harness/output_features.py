# SPDX-License-Identifier: Apache-2.0
"""The output features (per-request options, provenance, rows sent once, weight versions) on an e2e engine.

Runs after the offline scenario's reference checks, on its engine (``run_offline(after=...)``, the ``qwen3_moe``
eager run of every e2e release), every returned row compared with the transformers reference:

  * ``mixed``: one batch of requests opted out, opted in explicitly and left to the engine's flag;
  * ``prefix_of_opted_out``: an opted-in request whose prompt the prefix cache serves from an opted-out one's
    blocks (the opted-out request's rows were still stored for it);
  * ``omit_cached`` / ``omit_token``: a second turn of that conversation asking to omit the rows it holds
    (``"cached"``, or the held count as a token), its array added to ``replay.Conversation`` with the reported start;
  * ``samples``: an n = 2 request, each sample with its record;
  * ``straddle``: a request during which the workers load weights (``collective_rpc``: a bucket of the checkpoint's
    tensors through the model's ``load_weights``, where every framework's sync ends; the same values, so the rows
    stay the reference's), then one served from blocks cached before the update, then one after a prefix-cache reset;
  * ``refused``: malformed options, an omission past the prompt (and on vLLM 0.20.x / 0.21.0 any option).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_ascend_routing import replay
from vllm_ascend_routing.output import weights
from vllm_ascend_routing.preflight import models, offline
from vllm_ascend_routing.preflight.scenarios import _verdict, model_dir

MAX_TOKENS = 8
LONG = 200  # tokens: more than a KV block (128 tokens on the CPU), so its repeat is served from the prefix cache
STRADDLE_TOKENS = 12
RELOAD_AFTER_STEPS = 4  # the prefill (two chunks) and two decode steps run on the weights loaded at start-up


def output_part(llm: Any) -> dict[str, Any]:
    """The offline checks on ``llm``'s engine; ``seconds``: what they add to the scenario."""
    start = time.monotonic()
    result = _output_part(llm)
    result["output"]["seconds"] = round(time.monotonic() - start, 1)
    return result


def _output_part(llm: Any) -> dict[str, Any]:
    from vllm_ascend_routing.compat import adapter as get_adapter

    arch = Path(llm.llm_engine.model_config.model).name
    model = models.build_tiny_moe(arch, model_dir() / arch)
    reference = offline.reference_for(model)
    adapter = get_adapter()
    result: dict[str, Any] = {"generation": adapter.generation.value}
    if not adapter.per_request_output:  # 0.20.x, 0.21.0: every option refused, per request
        result["refused"] = {"any_option": _refusal(llm, [5, 6, 7], {"return_routed_experts": False})}
        return {"output": result}
    part = _Part(llm, model, reference)
    result["mixed"] = part.mixed()
    result.update(part.rows_sent_once())
    result["samples"] = part.samples()
    result["straddle"] = part.straddle()
    result["refused"] = {
        "malformed": _refusal(llm, [5, 6, 7], {"return_routed_experts": "maybe"}),
        "omit_past_prompt": _refusal(llm, [5, 6, 7], {"routed_experts_omit": 4}),
    }
    return {"output": result}


def _refusal(llm: Any, prompt: list[int], extra_args: dict[str, Any]) -> str:
    from vllm import SamplingParams

    try:
        llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, extra_args=extra_args), use_tqdm=False
        )
    except ValueError as error:
        return str(error)
    return "not refused"


def _params(max_tokens: int = MAX_TOKENS, extra_args: dict[str, Any] | None = None, n: int = 1) -> Any:
    from vllm import SamplingParams

    # n > 1 samples (vLLM refuses greedy there): each sample's rows are checked on the tokens it drew
    sampling = {"temperature": 0.0} if n == 1 else {"temperature": 1.0, "seed": 7}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n, extra_args=extra_args, **sampling)


SYNCED = ("model.embed_tokens.weight", "model.norm.weight")  # a weight-sync bucket: loaded as they are on the CPU


def _sync_weights(worker: Any) -> int | None:
    """In the worker (``collective_rpc``), as an RL framework's weight sync ends: the model's ``load_weights`` with a
    bucket of named tensors (the checkpoint's own values, so the rows stay the reference's); returns the worker's
    weight version. (vLLM's CPU layers repack most weights after loading, so a bucket of those could not be loaded
    again this way; vLLM's own ``reload_weights`` is checked apart, last: ``weight_reload.py``.)"""
    from safetensors import safe_open

    runner = worker.model_runner
    with safe_open(str(Path(runner.vllm_config.model_config.model) / "model.safetensors"), "pt") as checkpoint:
        bucket = [(name, checkpoint.get_tensor(name)) for name in SYNCED]
    runner.model.load_weights(bucket)
    return weights.current(runner)


class _Part:
    def __init__(self, llm: Any, model: models.TinyMoE, reference: Any) -> None:
        self.llm, self.model, self.reference = llm, model, reference

    def generate(self, prompts: list[list[int]], params: list[Any]) -> list[Any]:
        return list(self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))

    def check(self, prompt: list[int], output: Any) -> dict[str, Any]:
        """One sample's rows against the reference from its reported first token, and its record."""
        info = getattr(output, "routed_experts_info", "absent")
        routed = output.routed_experts
        if routed is None:
            return {"rows": None, "info": info}
        first = int(info["first_token"]) if isinstance(info, dict) else 0
        completion = offline.Completion(prompt, list(output.token_ids), routed)
        verdict = _verdict(offline.check(self.reference, self.model, [completion], prompt_start=first))
        return {
            **verdict,
            "shape": list(routed.shape),
            "expected_rows": len(prompt) + len(output.token_ids) - 1 - first,
            "info": info,
        }

    def mixed(self) -> list[dict[str, Any]]:
        prompts = models.mixed_prompts(8, seed=21, min_len=5, max_len=80)
        choices = [None, {"return_routed_experts": False}, None, {"return_routed_experts": True}] * 2
        outputs = self.generate(prompts, [_params(extra_args=choice) for choice in choices])
        return [
            {"asked": choice, **self.check(prompt, out.outputs[0])}
            for prompt, choice, out in zip(prompts, choices, outputs, strict=True)
        ]

    def rows_sent_once(self) -> dict[str, Any]:
        """Turn 1 opted out, then asked again opted in (its prefix served from the opted-out request's blocks); turn 2
        of that conversation omitting the rows held (``"cached"``; then a token), each kept once by
        ``replay.Conversation``, whose whole must be the reference's."""
        (long_prompt,) = models.mixed_prompts(1, seed=31, min_len=LONG, max_len=LONG)
        (opted_out,) = self.generate([long_prompt], [_params(extra_args={"return_routed_experts": False})])
        (first,) = self.generate([long_prompt], [_params()])
        out: dict[str, Any] = {
            "prefix_of_opted_out": {
                "opted_out_rows": None if opted_out.outputs[0].routed_experts is None else "returned",
                "cached_tokens": int(first.num_cached_tokens or 0),
                **self.check(long_prompt, first.outputs[0]),
            }
        }
        turn1 = first.outputs[0]
        context = long_prompt + list(turn1.token_ids) + models.mixed_prompts(1, seed=33, min_len=5, max_len=5)[0]
        for name, omit in (("omit_cached", "cached"), ("omit_token", len(context) - 5 - 1)):
            conversation = replay.Conversation()
            conversation.add_turn(turn1.routed_experts, len(long_prompt), len(turn1.token_ids), 0)
            (turn2,) = self.generate([context], [_params(extra_args={"routed_experts_omit": omit})])
            sample = turn2.outputs[0]
            part = {"asked": omit, "cached_tokens": int(turn2.num_cached_tokens or 0), **self.check(context, sample)}
            try:
                start = int(sample.routed_experts_info["first_token"])
                part["rows_added"] = conversation.add_turn(
                    sample.routed_experts, len(context), len(sample.token_ids), start
                )
                whole = np.concatenate(conversation.aligned().parts)
                tokens = offline.Completion(context, list(sample.token_ids), whole)
                part["conversation"] = _verdict(offline.check(self.reference, self.model, [tokens]))
                part["conversation"]["rows_kept"] = len(whole)
            except (ValueError, TypeError, KeyError) as error:
                part["conversation"] = {"error": str(error)}
            out[name] = part
        return out

    def samples(self) -> list[dict[str, Any]]:
        prompt = models.mixed_prompts(1, seed=41, min_len=30, max_len=30)[0]
        (result,) = self.generate([prompt], [_params(n=2)])
        return [self.check(prompt, sample) for sample in result.outputs]

    def straddle(self) -> dict[str, Any]:
        """A request stepped by hand while the worker reloads the weights after ``RELOAD_AFTER_STEPS`` steps; then its
        prompt again (blocks cached before the update); then, after a prefix-cache reset, a prompt asked twice."""
        engine = self.llm.llm_engine
        prompt = models.mixed_prompts(1, seed=51, min_len=LONG, max_len=LONG)[0]
        engine.add_request("straddle", {"prompt_token_ids": prompt}, _params(STRADDLE_TOKENS))
        final, steps, versions = None, 0, None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    final = output
            steps += 1
            if steps == RELOAD_AFTER_STEPS:
                versions = self.llm.collective_rpc(_sync_weights)
        assert final is not None
        out: dict[str, Any] = {"steps": steps, "versions_after_reload": versions, "cached": final.num_cached_tokens}
        out["request"] = self.check(prompt, final.outputs[0])
        out["request"]["generated_before_reload"] = RELOAD_AFTER_STEPS
        (again,) = self.generate([prompt], [_params()])
        out["cached_before_update"] = {
            "cached_tokens": int(again.num_cached_tokens or 0),
            **self.check(prompt, again.outputs[0]),
        }
        self.llm.reset_prefix_cache()
        fresh = models.mixed_prompts(1, seed=53, min_len=LONG, max_len=LONG)[0]
        self.generate([fresh], [_params()])
        (after_reset,) = self.generate([fresh], [_params()])
        out["cached_after_reset"] = {
            "cached_tokens": int(after_reset.num_cached_tokens or 0),
            **self.check(fresh, after_reset.outputs[0]),
        }
        return out


# ---- over HTTP: `vllm serve` (tests/harness/scenarios.py run_serve) ----

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"  # the prompt's text, as is


def server_args() -> list[str]:
    """Flags the serve scenario adds: a chat template (the tiny tokenizer has none), and vLLM's generate endpoint
    where the release puts it behind a flag."""
    flags = ["--chat-template", CHAT_TEMPLATE]
    try:
        from vllm.entrypoints.launchers.cli_args import BaseFrontendArgs  # 0.26+: scale-out endpoints behind a flag
    except ImportError:
        return flags
    fields = getattr(BaseFrontendArgs, "__dataclass_fields__", {})
    return [*flags, "--enable-scale-out"] if "enable_scale_out" in fields else flags


def decode(encoded: str) -> np.ndarray:
    import base64
    import io

    return np.load(io.BytesIO(base64.b64decode(encoded)))


def stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST with ``stream``: the decoded ``data:`` chunks up to ``[DONE]``."""
    import json
    import urllib.request

    request = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    chunks = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def serve_part(url: str, model: models.TinyMoE, reference: Any) -> dict[str, Any]:
    """The output features through the OpenAI server and vLLM's generate endpoint, every array checked;
    ``seconds``: what they add to the scenario."""
    start = time.monotonic()
    result = _serve_part(url, model, reference)
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def _serve_part(url: str, model: models.TinyMoE, reference: Any) -> dict[str, Any]:
    from tests.harness.server import post

    def verdict(prompt: list[int], token_ids: list[int], routed: np.ndarray | None, first: int = 0) -> dict[str, Any]:
        if routed is None:
            return {"rows": None}
        completion = offline.Completion(prompt, token_ids, routed)
        return {
            **_verdict(offline.check(reference, model, [completion], prompt_start=first)),
            "shape": list(routed.shape),
        }

    name = str(model.path)
    prompt = models.mixed_prompts(1, seed=61, min_len=40, max_len=40)[0]
    body = {"model": name, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    result: dict[str, Any] = {}
    full = post(f"{url}/v1/completions", {**body, "prompt": prompt})["choices"][0]
    routed = decode(full["routed_experts"])
    result["completion"] = {"info": full.get("routed_experts_info"), **verdict(prompt, full["token_ids"], routed)}
    chunks = stream(f"{url}/v1/completions", {**body, "prompt": prompt})
    choices = [choice for chunk in chunks for choice in chunk.get("choices", ())]
    with_rows = [choice for choice in choices if choice.get("routed_experts") is not None]
    tokens = [token for choice in choices for token in choice.get("token_ids") or ()]
    result["completion_stream"] = {
        "chunks": len(chunks),
        "chunks_with_rows": len(with_rows),
        "rows_in_finishing_chunk": bool(with_rows) and with_rows[-1].get("finish_reason") is not None,
        "same_as_non_streamed": bool(with_rows) and np.array_equal(decode(with_rows[-1]["routed_experts"]), routed),
        "info": with_rows[-1].get("routed_experts_info") if with_rows else None,
        **verdict(prompt, tokens, decode(with_rows[-1]["routed_experts"]) if with_rows else None),
    }
    out_args = {"vllm_xargs": {"return_routed_experts": False}}
    opted = post(f"{url}/v1/completions", {**body, "prompt": prompt, **out_args})["choices"][0]
    opted_chunks = stream(f"{url}/v1/completions", {**body, "prompt": prompt, **out_args})
    result["opted_out"] = {
        "routed_experts": opted.get("routed_experts"),
        "info": opted.get("routed_experts_info", "absent"),
        "streamed_rows": sum("routed_experts" in c for chunk in opted_chunks for c in chunk.get("choices", ())),
    }
    (long_prompt,) = models.mixed_prompts(1, seed=63, min_len=LONG, max_len=LONG)
    post(f"{url}/v1/completions", {**body, "prompt": long_prompt})
    omitted = post(
        f"{url}/v1/completions", {**body, "prompt": long_prompt, "vllm_xargs": {"routed_experts_omit": "cached"}}
    )
    choice = omitted["choices"][0]
    info = choice.get("routed_experts_info") or {}
    first = int(info.get("first_token", 0))
    result["omit_cached"] = {
        "info": info,
        **verdict(long_prompt, choice["token_ids"], decode(choice["routed_experts"]), first),
    }
    chat = {
        **body,
        "messages": [{"role": "user", "content": models.prompt_text(prompt)}],
    }
    chat.pop("return_token_ids")
    chat_full = post(f"{url}/v1/chat/completions", chat)["choices"][0]
    chat_chunks = stream(f"{url}/v1/chat/completions", chat)
    chat_rows = [c for chunk in chat_chunks for c in chunk.get("choices", ()) if c.get("routed_experts") is not None]
    result["chat"] = {
        "same_as_completion": np.array_equal(decode(chat_full["routed_experts"]), routed),
        "info": chat_full.get("routed_experts_info"),
    }
    result["chat_stream"] = {
        "chunks_with_rows": len(chat_rows),
        "rows_in_finishing_chunk": bool(chat_rows) and chat_rows[-1].get("finish_reason") is not None,
        "same_as_completion": bool(chat_rows) and np.array_equal(decode(chat_rows[-1]["routed_experts"]), routed),
        "info": chat_rows[-1].get("routed_experts_info") if chat_rows else None,
    }
    generate: dict[str, Any] = {
        "model": name,
        "token_ids": prompt,
        "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    try:
        generated = post(f"{url}/inference/v1/generate", generate)["choices"][0]
    except OSError as error:  # HTTPError 404: no generate endpoint in this release
        reason = error.read().decode(errors="replace")[:500] if hasattr(error, "read") else ""
        result["generate"] = {"error": f"{error}: {reason}"}
        return result
    generate_chunks = stream(f"{url}/inference/v1/generate", generate)
    generate_rows = [
        c for chunk in generate_chunks for c in chunk.get("choices", ()) if c.get("routed_experts") is not None
    ]
    result["generate"] = {
        "same_as_completion": np.array_equal(decode(generated["routed_experts"]), routed),
        "info": generated.get("routed_experts_info"),
    }
    result["generate_stream"] = {
        "chunks_with_rows": len(generate_rows),
        "rows_in_finishing_chunk": bool(generate_rows) and generate_rows[-1].get("finish_reason") is not None,
        "same_as_completion": bool(generate_rows)
        and np.array_equal(decode(generate_rows[-1]["routed_experts"]), routed),
        "info": generate_rows[-1].get("routed_experts_info") if generate_rows else None,
    }
    return result
