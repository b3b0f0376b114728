# SPDX-License-Identifier: Apache-2.0
"""The row store end to end (``scenarios store``): an OpenAI server whose engine publishes each request's rows to the
store given (``shm``, or a Mooncake master's URL), this process as the trainer fetching them by key, every fetched row
against the transformers reference.

  * ``completions``: 3 prompts x n = 2 non-streamed (each sample its own key, its own rows), fetched as a batch;
  * ``streamed``: the key in the choice's finishing chunk; ``chat``: the key of a chat completion; ``generate``: vLLM's
    ``/inference/v1/generate`` (behind ``--enable-scale-out`` where the release has it);
  * ``inline``: ``vllm_xargs {"routed_experts_transport": "inline"}``: the rows in the response, no key;
  * ``lazy``: a PP-stage x CP-rank slice packed from keys (``replay.to_megatron``) equals the one packed from the
    fetched arrays, and reads no more than the slice;
  * ``release`` / ``made_up``: a released and a made-up key are refused by name;
  * ``after_restart``: once the server has exited, every key it gave is refused (never another start's rows).

``--store mooncake``: the same against a real ``mooncake_master`` this process starts on localhost (TCP; the scenario
runs with ``scripts/mooncake_kit.py``'s environment), then ``master_killed``: the master SIGKILLed mid-run, the next
request's rows come inline, exact, with the record saying why; keys of the exited server then never resolve.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from tests.harness.output_features import decode, server_args, stream
from tests.harness.server import Server, post
from vllm_ascend_routing import replay
from vllm_ascend_routing.preflight import models, offline
from vllm_ascend_routing.preflight.scenarios import MAX_BATCHED_TOKENS, _verdict, model_dir

MAX_TOKENS = 8


def run_store(arch: str, store: str) -> dict[str, Any]:
    if store != "mooncake":
        return _run_store(arch, store, None)
    from tests.scripts import load

    kit = load("scripts/mooncake_kit.py", "mooncake_kit").kit
    from tests.harness.mooncake_master import MooncakeMaster

    with MooncakeMaster(kit().master_binary, dict(os.environ)) as master:  # this process has the kit's environment
        return _run_store(arch, master.url, master)


def _run_store(arch: str, store: str, master: Any) -> dict[str, Any]:
    os.environ["VLLM_ASCEND_ROUTING_STORE"] = store  # the server's engine and this trainer use the same store
    model = models.build_tiny_moe(arch, model_dir() / arch)
    reference = offline.reference_for(model)
    args = [
        "--kv-cache-memory-bytes", str(offline.KV_CACHE_BYTES), "--max-model-len", "1024",
        "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), "--enforce-eager", "--enable-prefix-caching",
        *server_args(),
    ]  # fmt: skip
    result: dict[str, Any] = {"store": store.split(":")[0]}
    from vllm_ascend_routing.compat import adapter as get_adapter

    if not get_adapter().per_request_output:  # 0.20.x / 0.21.0: refused at start-up, by name
        result["refused"] = _refusal(Server(model.path, args))
        return result
    started = time.monotonic()
    with Server(model.path, args) as server:
        result["startup_s"] = round(time.monotonic() - started, 1)
        result.update(_requests(server.url, model, reference))
        keys = result.pop("keys")
        if master is not None:
            master.kill()
            result["master_killed"] = _inline_fallback(server.url, model, reference)
    gone, refused = [], []
    for key in keys:
        try:
            replay.fetch(key)
        except replay.UnknownKeyError as error:
            gone.append(key in str(error))
        except replay.StoreError as error:  # the master is gone: nothing resolves (never another start's rows)
            refused.append(type(error).__name__)
    result["after_restart"] = {"keys": len(keys), "refused_by_name": sum(gone), "store_gone": len(refused)}
    return result


def _inline_fallback(url: str, model: models.TinyMoE, reference: Any) -> dict[str, Any]:
    """A request after the store's master died: its rows inline, exact, and the record says why."""
    (prompt,) = models.mixed_prompts(1, seed=73, min_len=30, max_len=30)
    body = {"model": str(model.path), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    started = time.monotonic()
    choice = post(f"{url}/v1/completions", body)["choices"][0]
    info = choice.get("routed_experts_info") or {}
    routed = decode(choice["routed_experts"]) if choice.get("routed_experts") else None
    return {
        "seconds": round(time.monotonic() - started, 1),
        "key": info.get("store_key"),
        "fallback": info.get("store_fallback"),
        **_verdict(offline.check(reference, model, [offline.Completion(prompt, list(choice["token_ids"]), routed)])),
    }


def _requests(url: str, model: models.TinyMoE, reference: Any) -> dict[str, Any]:
    name = str(model.path)
    body = {"model": name, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 7, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    prompts = models.mixed_prompts(3, seed=71, min_len=20, max_len=60)
    out: dict[str, Any] = {}
    completions, keys, infos, sizes = [], [], [], []
    for prompt in prompts:
        reply = post(f"{url}/v1/completions", {**body, "prompt": prompt, "n": 2})
        sizes.append(len(_raw(reply)))
        for choice in reply["choices"]:
            info = choice.get("routed_experts_info") or {}
            infos.append(info)
            keys.append(info.get("store_key"))
            completions.append((prompt, list(choice["token_ids"]), choice.get("routed_experts")))
    fetched = replay.fetch([key for key in keys if key])
    checked = [offline.Completion(p, t, a) for (p, t, _), a in zip(completions, fetched, strict=False)]
    out["completions"] = {
        **_verdict(offline.check(reference, model, checked)),
        "samples": len(completions),
        "keys": len({key for key in keys if key}),
        "inline_rows": sum(rows is not None for _, _, rows in completions),
        "records_agree": all(
            info.get("rows") == len(array) and info.get("first_token") == 0 and info.get("dtype") == str(array.dtype)
            for info, array in zip(infos, fetched, strict=False)
        ),
        "distinct_samples": len({array.tobytes() for array in fetched}),
        "max_response_bytes_per_choice": max(sizes) // 2,
    }
    prompt = prompts[0]
    chunks = stream(f"{url}/v1/completions", {**body, "prompt": prompt, "temperature": 0})
    choices = [choice for chunk in chunks for choice in chunk.get("choices", ())]
    finishing = [choice for choice in choices if choice.get("finish_reason") is not None]
    tokens = [token for choice in choices for token in choice.get("token_ids") or ()]
    key = (finishing[-1].get("routed_experts_info") or {}).get("store_key") if finishing else None
    out["streamed"] = {
        "key_in_finishing_chunk": key is not None,
        "rows_in_any_chunk": sum(choice.get("routed_experts") is not None for choice in choices),
        **(
            _verdict(offline.check(reference, model, [offline.Completion(prompt, tokens, replay.fetch(key))]))
            if key
            else {}
        ),
    }
    chat = {**body, "temperature": 0, "messages": [{"role": "user", "content": models.prompt_text(prompt)}]}
    chat.pop("return_token_ids")
    chat_choice = post(f"{url}/v1/chat/completions", chat)["choices"][0]
    chat_key = (chat_choice.get("routed_experts_info") or {}).get("store_key")
    out["chat"] = {"key": chat_key is not None, "rows_inline": chat_choice.get("routed_experts") is not None}
    if chat_key is not None:
        out["chat"]["rows"] = int(replay.fetch(chat_key).shape[0])
        keys.append(chat_key)
    generate = {"model": name, "token_ids": prompt,
                "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    generated = post(f"{url}/inference/v1/generate", generate)["choices"][0]
    generate_key = (generated.get("routed_experts_info") or {}).get("store_key")
    out["generate"] = {"key": generate_key is not None, "rows_inline": generated.get("routed_experts") is not None}
    if generate_key is not None:
        tokens = list(generated["token_ids"])
        checked_generate = [offline.Completion(prompt, tokens, replay.fetch(generate_key))]
        out["generate"].update(_verdict(offline.check(reference, model, checked_generate)))
        keys.append(generate_key)
    inline_args = {"vllm_xargs": {"routed_experts_transport": "inline"}}
    inline = post(f"{url}/v1/completions", {**body, "prompt": prompt, "temperature": 0, **inline_args})["choices"][0]
    routed = decode(inline["routed_experts"]) if inline.get("routed_experts") else None
    out["inline"] = {
        "key": (inline.get("routed_experts_info") or {}).get("store_key"),
        **_verdict(offline.check(reference, model, [offline.Completion(prompt, inline["token_ids"], routed)])),
    }
    stored = [str(key) for key in keys if key]
    out["lazy"] = _lazy_slice(stored[:6], completions, model)
    released = stored[0]
    out["release"] = {"freed": replay.release([released]), "refused_by_name": _refused(released)}
    made_up = released.rsplit(".", 1)[0] + "." + "0" * 32
    out["made_up"] = {"refused_by_name": _refused(made_up)}
    out["keys"] = [key for key in keys[1:] if key]
    return out


def _lazy_slice(keys: list[str], completions: list[Any], model: models.TinyMoE) -> dict[str, Any]:
    """Stage 2 of PP=2 (its MoE layers) x CP rank 1 of 2, from keys and from the fetched arrays."""
    moe = list(model.moe_layers)
    stage = moe[len(moe) // 2 :]
    lengths = [(len(p), len(t)) for p, t, _ in completions]
    lazy = [replay.align(key, p, o) for key, (p, o) in zip(keys, lengths, strict=True)]
    whole = [replay.align(replay.fetch(key), p, o) for key, (p, o) in zip(keys, lengths, strict=True)]
    shard = replay.Shard(layers=stage, cp_rank=1, cp_size=2)
    a = replay.to_megatron(lazy, moe, model.num_experts, pad_to=4, shard=shard)
    b = replay.to_megatron(whole, moe, model.num_experts, pad_to=4, shard=shard)
    read = sum(sample.parts[0].reads.bytes for sample in lazy)
    top_k = int(a.ids.shape[-1]) if a.ids.ndim == 3 else 0
    its_slice = int(a.valid.sum()) * len(stage) * top_k * np.dtype(lazy[0].parts[0].dtype).itemsize
    return {
        "equal": bool((a.ids == b.ids).all() and (a.valid == b.valid).all()),
        "bytes_read": read,
        "slice_bytes": its_slice,
        "whole_bytes": sum(sample.nbytes for sample in whole),
    }


def _refusal(server: Server) -> str:
    try:
        with server:
            return "not refused"
    except RuntimeError:
        with open(server.log_path) as log:
            lines = [line for line in log if "VLLM_ASCEND_ROUTING_STORE" in line]
        return lines[-1].strip() if lines else "refused without naming the store"


def _refused(key: str) -> bool:
    try:
        replay.fetch(key)
    except replay.UnknownKeyError as error:
        return key in str(error)
    return False


def _raw(reply: Any) -> str:
    import json

    return json.dumps(reply)
