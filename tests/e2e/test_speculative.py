# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding (n-gram; a tiny MoE draft model) with the plugin: every (token, MoE layer) row of
every request equals the reference on prompt + output[:-1], vLLM's own counters show drafts proposed and
accepted (and rejected, for n-gram), and the tokens equal a run without speculation.

The requests are built for it: repetitive prompts (the n-gram proposer finds matches), uneven
``max_tokens`` (requests stop inside accepted runs), a chunked prefill and its prefix-cache repeat. The
draft model is the target itself: its MoE layers carry the target's layer ids, so a draft layer writing
the step's rows would corrupt them. Runs on ``make test``'s releases and on the speculative-only ones
(``E2E_SPEC_RELEASES``). Releases whose own CPU speculative path crashes before its first step (a known
upstream bug, with or without the plugin) are listed in ``release_roles.CPU_SPEC_BROKEN``: there the tests skip by
release, without starting an engine; on every other release a crash is a failure.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests import release_roles
from tests.harness import distributed, scenarios
from vllm_ascend_routing.releases import version_key

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.spec]


def run(scenario: Any, *args: str, in_process: bool = True) -> dict[str, Any]:
    """The scenario's verdict; skipped (before any engine) on a release listed as broken upstream."""
    release = distributed.vllm_release()
    broken = next(
        (why for listed, why in release_roles.CPU_SPEC_BROKEN.items() if version_key(listed) == version_key(release)),
        None,
    )
    if broken is not None:
        pytest.skip(f"vLLM {release}'s own CPU speculative decoding crashes (release_roles.CPU_SPEC_BROKEN): {broken}")
    result = scenario(*args, in_process=in_process)
    assert not result.get("upstream_crash"), (
        f"speculative decoding crashed on vLLM {release}, which release_roles.CPU_SPEC_BROKEN does not list: "
        f"{result['upstream_crash']}"
    )
    return dict(result)


@pytest.fixture(scope="module")
def baseline(scenario: Any) -> dict[str, Any]:
    """The same requests without speculation (plugin on): the tokens speculation must reproduce."""
    return run(scenario, "speculative", "--spec", "none")


def assert_exact(result: dict[str, Any], baseline: dict[str, Any]) -> None:
    for part in ("batch", "chunked_prefill", "prefix_repeat"):
        assert result[part]["ok"], (part, result[part]["problems"])
        assert result[part]["rows"] > 0
    assert result["prefix_repeat"]["cached_tokens"] > 0  # the repeat really came from the prefix cache
    assert result["batch"]["output_ids"] == baseline["batch"]["output_ids"]
    assert result["prefix_repeat"]["output_ids"] == baseline["prefix_repeat"]["output_ids"]
    assert [len(ids) for ids in result["batch"]["output_ids"]] == scenarios.SPEC_MAX_TOKENS


def test_ngram_offline_exact(scenario: Any, baseline: dict[str, Any]) -> None:
    result = run(scenario, "speculative", "--spec", "ngram", "--k", "3")
    assert_exact(result, baseline)
    counts = result["spec_decode"]
    # drafts proposed, some accepted and some rejected: the rejected rows had to be dropped
    assert counts["drafts"] > 0 and 0 < counts["accepted_tokens"] < counts["draft_tokens"], counts
    assert baseline["spec_decode"]["drafts"] == 0
    print(
        f"ngram k=3: {counts}, rows {result['batch']['rows']} + {result['chunked_prefill']['rows']} + "
        f"{result['prefix_repeat']['rows']} exact"
    )


def test_draft_model_offline_exact(scenario: Any, baseline: dict[str, Any]) -> None:
    """A MoE draft model whose layer ids alias the target's: only the target's layers write rows."""
    result = run(scenario, "speculative", "--spec", "draft", "--k", "2")
    assert_exact(result, baseline)
    counts = result["spec_decode"]
    assert counts["drafts"] > 0 and counts["accepted_tokens"] == counts["draft_tokens"] > 0, counts  # itself
    print(f"draft model k=2: {counts}, rows {result['batch']['rows']} exact")


def test_ngram_serve_exact(scenario: Any, generation: str, baseline: dict[str, Any]) -> None:
    """Through `vllm serve` (multi-process engine), OpenAI completions."""
    if generation == "shm":
        pytest.skip("vLLM 0.20.x has no routed_experts field in its OpenAI API (nothing to return over HTTP)")
    result = run(scenario, "serve", "--spec", "ngram", "--k", "3", in_process=False)["serve"]
    assert result["ok"], result["problems"]
    counts = result["spec_decode"]
    assert counts["drafts"] > 0 and counts["accepted_tokens"] > 0, counts
    assert [len(ids) for ids in result["output_ids"]] == scenarios.SPEC_MAX_TOKENS
    print(f"serve ngram k=3: {counts}, rows {result['rows']} exact")
