# SPDX-License-Identifier: Apache-2.0
"""Two engines of a P/D scenario alive at once: the producer (prefill) in a child process, the consumer (decode) in
this one, talking through files in an exchange folder (``nixl_pd.py``, ``mooncake_pd.py``)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_ascend_routing import kv
from vllm_ascend_routing.preflight import models, offline
from vllm_ascend_routing.preflight.scenarios import MAX_TOKENS, _verdict

# The follower's counts each consumer phase reports (this process's: the consumer's engine core runs here).
COUNTS = ("rows_loaded", "rows_declined", "offers_declined", "requests_waited")


def wait_for(path: Path, process: subprocess.Popen[str] | None, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the producer exited ({process.returncode}) before writing {path.name}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.2)


def write(path: Path, value: Any) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(value))
    path.with_suffix(".tmp").rename(path)


def with_producer(
    module: str,
    arch: str,
    exchange: Path,
    environment: dict[str, str],
    consume: Callable[[subprocess.Popen[str]], dict[str, Any]],
) -> dict[str, Any]:
    """Start ``python -m module --arch ARCH --exchange DIR`` (the producer), run ``consume(child)`` here, tell the
    producer the consumer is done (``consumer.done``) and read what it wrote (``producer.json``); the producer's log is
    shown when it fails, and the exchange folder removed."""
    log_path = exchange / "producer.log"  # a file, not a pipe: nothing reads a pipe while the consumer runs
    with log_path.open("w") as log_file:
        child = subprocess.Popen(
            [sys.executable, "-m", module, "--arch", arch, "--exchange", str(exchange)],
            env=environment,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
        )
    started = time.monotonic()
    out: dict[str, Any] = {"arch": arch, "phases": {}}
    try:
        out.update(consume(child))
        (exchange / "consumer.done").write_text("1")
        wait_for(exchange / "producer.json", child, 300)
        out["producer"] = json.loads((exchange / "producer.json").read_text())
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            (exchange / "consumer.done").write_text("1")
            child.kill()
        child.wait()
        if child.returncode != 0 or "producer" not in out:  # shown with the scenario's output when it fails
            print(f"== the producer (exit {child.returncode}):\n{log_path.read_text()[-4000:]}", flush=True)
        shutil.rmtree(exchange, ignore_errors=True)
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def connector_engine(model: models.TinyMoE, budget: int, block_size: int, **connector: Any) -> Any:
    """An engine of a two-engine scenario: eager, prefix caching on, ``block_size``, ``budget`` tokens a step, the KV
    connector ``KVTransferConfig(**connector)``."""
    from vllm.config import KVTransferConfig

    return offline.make_llm(
        model,
        enforce_eager=True,
        block_size=block_size,
        max_num_batched_tokens=budget,
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(**connector),
    )


def phase_runner(
    llm: Any, model: models.TinyMoE, phases: dict[str, Any], extra_args: dict[str, Any] | None = None
) -> Callable[..., list[offline.Completion]]:
    """``phase(name, batch, params=None, salts=None)``: the batch generated on the consumer (each prompt with its
    ``kv_transfer_params``, ``extra_args`` and cache salt), its rows against the reference, the follower's counts and
    each request's ``routed_experts_info["loaded"]``, filed under ``phases[name]``."""
    reference = offline.reference_for(model)

    def phase(
        name: str,
        batch: list[list[int]],
        params: list[dict[str, Any] | None] | None = None,
        salts: list[str] | None = None,
    ) -> Any:
        before, started = kv.stats(), time.monotonic()
        extra: list[dict[str, Any] | None] | None = [extra_args] * len(batch) if extra_args else None
        done = offline.generate(llm, batch, MAX_TOKENS, kv_transfer_params=params, extra_args=extra, salts=salts)
        after = kv.stats()
        verdict = _verdict(offline.check(reference, model, done))
        verdict["seconds"] = round(time.monotonic() - started, 1)
        verdict.update({field: getattr(after, field) - getattr(before, field) for field in COUNTS})
        verdict["info_loaded"] = [None if c.info is None else c.info["loaded"] for c in done]
        verdict["requests"] = len(done)
        phases[name] = verdict
        return done

    return phase


def producer_main(description: str, producer: Callable[[str, Path], None]) -> None:
    """The producer process's command line (``--arch``, ``--exchange``): what ``with_producer`` starts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--arch", required=True)
    parser.add_argument("--exchange", required=True, type=Path)
    args = parser.parse_args()
    producer(args.arch, args.exchange)
