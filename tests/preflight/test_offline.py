# SPDX-License-Identifier: Apache-2.0
"""What doctor's engines get on the CPU build before they start: one core list per rank (vLLM would bind each
rank to a NUMA node of its own and refuses more ranks than nodes), set only where the environment has none."""

from __future__ import annotations

import os

import pytest

from vllm_ascend_routing.preflight import offline


@pytest.mark.parametrize(
    ("cores", "ranks", "binding"),
    [
        ({0, 1}, 1, None),  # one rank: vLLM's own binding (one NUMA node is enough)
        ({0, 1}, 2, "0|1"),
        ({0, 1, 2, 3, 4, 5, 6, 7}, 2, "0,1,2,3|4,5,6,7"),
        ({0, 1, 2, 3, 4, 5, 6, 7}, 4, "0,1|2,3|4,5|6,7"),
        ({2, 5, 9}, 2, "2|5"),  # the cores this process may use, not 0..n
        ({3}, 2, "3|3"),  # fewer cores than ranks: shared
    ],
)
def test_each_rank_gets_a_core_list_of_its_own(
    monkeypatch: pytest.MonkeyPatch, cores: set[int], ranks: int, binding: str | None
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    assert offline.cpu_thread_binding(ranks) == binding


def test_the_engine_env_is_set_only_where_unset_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the user's own value wins
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    set_here = offline.set_engine_env(wanted)
    assert set_here == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    line = offline.engine_env_line(set_here)
    assert line.startswith("set by doctor for this engine: VLLM_CPU_OMP_THREADS_BIND=0|1 (one core list per CPU rank")
    assert offline.engine_env_line({}).startswith("doctor set no vLLM variable")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")


def test_every_model_recipe_is_listed_once_and_builds_its_config() -> None:
    """The tiny models are one table of recipes (``models.RECIPES``: the doctor's, then the suite's and the benchmarks'
    registered by ``tests.harness.model_recipes``), each a transformers config class and what differs from the common
    fields: every listed architecture has one, and each yields a config of its layer count."""
    from tests.harness import model_recipes
    from vllm_ascend_routing.preflight import models

    assert set(model_recipes.RECIPES) <= set(models.RECIPES) and not set(model_recipes.RECIPES) & set(
        models.ARCHITECTURES
    )
    assert sorted(model_recipes.ALL_ARCHITECTURES) == sorted(models.RECIPES)
    assert len(set(model_recipes.ALL_ARCHITECTURES)) == len(model_recipes.ALL_ARCHITECTURES)
    for architecture, (_, fields) in models.RECIPES.items():
        config = models.model_config(architecture)
        assert config.num_hidden_layers == fields["num_hidden_layers"] and config.vocab_size == models.VOCAB_SIZE
    with pytest.raises(ValueError, match="unknown architecture"):
        models.model_config("qwen3_moe_nonexistent")
