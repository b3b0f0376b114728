# SPDX-License-Identifier: Apache-2.0
"""``benchmarks/overhead_engine.py`` (make bench): the compile cache primed once per graph, and the per-step timer
that splits a decode step into the forward and the rest."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from tests import scripts

engine = scripts.load("benchmarks/overhead_engine.py", "_bench_overhead_engine")


def test_prime_compile_cache_starts_one_engine_per_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []

    class Recorded:
        def __init__(self, mode: str, args: argparse.Namespace, cache_root: str) -> None:
            started.append(mode)

        def close(self) -> None:
            started.append("closed")

    monkeypatch.setattr(engine, "Engine", Recorded)
    engine.prime_compile_cache(["vllm", "plugin", "vllm-control"], argparse.Namespace(), "/cache")
    assert started == ["vllm", "closed", "plugin", "closed"]
    started.clear()
    engine.prime_compile_cache(["off", "plugin", "vllm", "control", "unchecked"], argparse.Namespace(), "/cache")
    assert started == ["off", "closed", "plugin", "closed", "vllm", "closed"]


def test_engine_method_names_how_the_engines_ran() -> None:
    kept = engine.engine_method(argparse.Namespace(multiprocess=False, fresh_engines=False))
    fresh = engine.engine_method(argparse.Namespace(multiprocess=True, fresh_engines=True))
    assert kept.startswith("one warmed engine per mode, in-process") and "primed cache" in kept
    assert fresh.startswith("new engine processes every round, multi-process") and "primed cache" in fresh


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_runner(clock: FakeClock) -> Any:
    """A runner whose methods advance the clock: forward 5 s, the rest of execute_model 1 s, sampling 2 s."""

    def model_forward(*args: Any, **kwargs: Any) -> str:
        clock.now += 5.0
        return "hidden"

    runner = SimpleNamespace(_model_forward=model_forward)

    def execute_model(scheduler_output: Any) -> str:
        clock.now += 1.0
        return str(runner._model_forward())  # the runner calls its forward through the instance, as vLLM's does

    def sample_tokens(grammar: Any = None) -> str:
        clock.now += 2.0
        return "tokens"

    runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
    return runner


def test_step_timer_splits_each_step_into_forward_and_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(engine.time, "perf_counter", clock)
    worker = SimpleNamespace(model_runner=fake_runner(clock))
    engine.install_step_timer(worker)
    runner = worker.model_runner
    for tokens in (64, 300, 64):
        assert runner.execute_model(SimpleNamespace(total_num_scheduled_tokens=tokens)) == "hidden"
        assert runner.sample_tokens(None) == "tokens"
    steps = engine.take_step_times(worker)
    assert steps == [[64.0, 6.0, 5.0, 2.0], [300.0, 6.0, 5.0, 2.0], [64.0, 6.0, 5.0, 2.0]]
    assert engine.take_step_times(worker) == []  # taken: the next batch starts empty
    split = engine.step_split(steps, 64)
    assert split == {"steps": 2, "forward_us": 5e6, "rest_us": 3e6}  # rest: execute 6 + sample 2 - forward 5
    assert engine.step_split(steps, 128) == {"steps": 0}


def test_step_timer_records_a_step_that_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(engine.time, "perf_counter", clock)
    runner = fake_runner(clock)

    def failing_forward(*args: Any, **kwargs: Any) -> str:
        clock.now += 4.0
        raise RuntimeError("forward failed")

    runner._model_forward = failing_forward
    worker = SimpleNamespace(model_runner=runner)
    engine.install_step_timer(worker)
    with pytest.raises(RuntimeError, match="forward failed"):
        worker.model_runner.execute_model(SimpleNamespace(total_num_scheduled_tokens=8))
    assert engine.take_step_times(worker) == [[8.0, 5.0, 4.0, 0.0]]
