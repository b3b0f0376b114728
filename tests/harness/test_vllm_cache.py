# SPDX-License-Identifier: Apache-2.0
"""The tests' VLLM_CACHE_ROOTs: new ones hold no compiled graph, and all share one model-info folder per release."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from tests.harness import vllm_cache


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_CACHE", str(tmp_path / "ours"))
    return tmp_path / "ours"


def test_fresh_roots_share_the_model_info_of_their_release(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.30.0")
    first = vllm_cache.fresh_cache_root(tmp_path / "a" / "cache")
    second = vllm_cache.fresh_cache_root(tmp_path / "b")
    shared = cache / "vllm-model-info" / "0.30.0"
    assert (first / "modelinfos").resolve() == (second / "modelinfos").resolve() == shared.resolve()
    (first / "modelinfos" / "x-Model.json").write_text("{}")  # what vLLM writes in one root, the next one reads
    assert (second / "modelinfos" / "x-Model.json").read_text() == "{}"
    assert sorted(p.name for p in first.iterdir()) == ["modelinfos"]  # nothing else: no compiled graph kept


def test_each_release_has_its_own_folder_and_a_root_is_made_once(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.32.0")
    root = vllm_cache.fresh_cache_root(tmp_path / "root")
    assert vllm_cache.fresh_cache_root(root) == root  # again: the link is kept, not an error
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.20.2")
    other = vllm_cache.fresh_cache_root(tmp_path / "other")
    assert (root / "modelinfos").resolve() != (other / "modelinfos").resolve()
    assert (other / "modelinfos").resolve() == (cache / "vllm-model-info" / "0.20.2").resolve()


def test_without_vllm_the_folder_says_so(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    root = vllm_cache.fresh_cache_root(tmp_path / "root")
    assert (root / "modelinfos").resolve() == (cache / "vllm-model-info" / "none").resolve()
