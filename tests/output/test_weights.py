# SPDX-License-Identifier: Apache-2.0
"""The weight version: counted where the model's weights are loaded, stamped on each step's output."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm_ascend_routing.output import weights


class Model:
    def __init__(self) -> None:
        self.loaded: list[Any] = []

    def load_weights(self, weights_iterator: Any) -> set[str]:
        self.loaded.append(list(weights_iterator))
        return {"w"}


def test_each_completed_load_weights_call_moves_the_version() -> None:
    runner = SimpleNamespace(model=Model())
    weights.track(runner)
    assert weights.current(runner) == 1  # the weights loaded at start-up
    assert runner.model.load_weights([("w", 1)]) == {"w"}
    runner.model.load_weights([("w", 2)])
    assert weights.current(runner) == 3 and runner.model.loaded == [[("w", 1)], [("w", 2)]]
    weights.track(runner)  # tracked again (a reloaded model): one wrapper, counting from 1 again
    runner.model.load_weights([])
    assert weights.current(runner) == 2


def test_the_unwrapped_model_is_the_one_counted() -> None:
    inner = Model()
    runner = SimpleNamespace(model=SimpleNamespace(), get_model=lambda: inner)  # e.g. a CUDA-graph wrapper
    weights.track(runner)
    inner.load_weights([])
    assert weights.current(runner) == 2 and weights.current(SimpleNamespace()) is None


class AsyncOutput:
    def __init__(self, output: Any) -> None:
        self._output = output

    def get_output(self) -> Any:
        return self._output


def test_stamp_marks_the_output_the_scheduler_reads() -> None:
    output = SimpleNamespace()
    assert getattr(weights.stamp(output, 4), weights.VERSION) == 4
    pending = weights.stamp(AsyncOutput(SimpleNamespace()), 5)
    assert getattr(pending.get_output(), weights.VERSION) == 5  # once the asynchronous copy resolved
    assert weights.stamp(None, 1) is None
    unknown = SimpleNamespace()
    weights.stamp(unknown, None)
    assert not hasattr(unknown, weights.VERSION)


def test_the_worker_stamps_each_step_with_the_version_its_forward_ran_with() -> None:
    runner = SimpleNamespace(model=Model())
    weights.track(runner)

    class Worker:
        model_runner = runner

        def execute_model(self, scheduler_output: Any) -> Any:
            return None  # the output comes from sample_tokens

        def sample_tokens(self, grammar_output: Any) -> Any:
            runner.model.load_weights([])  # an update racing the step changes nothing about its stamp
            return SimpleNamespace()

    Worker.execute_model = weights._executing(Worker.execute_model)  # type: ignore[method-assign]
    Worker.sample_tokens = weights._sampling(Worker.sample_tokens)  # type: ignore[method-assign]
    worker = Worker()
    assert worker.execute_model(None) is None
    assert getattr(worker.sample_tokens(None), weights.VERSION) == 1
    worker.execute_model(None)
    assert getattr(worker.sample_tokens(None), weights.VERSION) == 2
