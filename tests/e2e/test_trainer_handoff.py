# SPDX-License-Identifier: Apache-2.0
"""vLLM's routed experts through verl 0.9.1's own R3 code into Megatron-Core's routers, row by row.

The vLLM side (``tests/harness/verl_handoff.py``, one engine per model, plugin on, strict validation) generates four
prompt/response shapes on a uint8 model with a dense middle layer and on a 288-expert model (uint16, dense
layer 0), and keeps each array as vLLM returned it with the transformers reference. The trainer side
(``tests/harness/verl_replay.py``) runs in every trainer environment of ``VLLM_ASCEND_ROUTING_TEST_TRAINER_PYTHONS``
(``make test-e2e`` sets it from ``TRAINER_ENVS``: verl 0.9.1 on Megatron-Core 0.16.1 and 0.19.2): verl's agent-loop
placement, its unpadding and micro-batching, ``align_r3_router_replay_data``, ``build_r3_replay_mask`` and
``set_router_replay_data`` into a real ``TransformerBlock``, at TP 1 and at TP 2 (sequence-parallel rows,
padding). Every (token, MoE layer) row vLLM recorded must be replayed with the reference's set, in the forward
and in the recompute; the rows verl leaves native must be exactly each sequence's last token and its padding.

Runs on ``FULL_RELEASE`` only (CI time: two engine starts and four trainer runs). On another release:

    VLLM_ASCEND_ROUTING_TEST_TRAINER_RELEASES="0.23.0 0.32.0" make test-e2e E2E_RELEASES="0.23.0 0.32.0"

(or ``...=all``); by hand, in any vLLM environment and then any trainer environment:

    python -m tests.harness.scenarios verl-handoff --arch qwen3_moe_dense --out DIR
    python -m tests.harness.scenarios verl-handoff --arch qwen3_moe_wide --out DIR
    TRAINER_PYTHON -m tests.harness.verl_replay --tp 2 DIR/qwen3_moe_dense DIR/qwen3_moe_wide
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import release_roles, settings
from tests.harness import distributed, pythonpath, verl_handoff

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.trainer]

FULL_RELEASE = release_roles.FULL_E2E_RELEASE
RELEASES_VARIABLE = "VLLM_ASCEND_ROUTING_TEST_TRAINER_RELEASES"  # more releases to run it on ("all": any)
TRAINER_TIMEOUT_S = 900
TENSOR_PARALLEL = (1, 2)
# What vLLM returns per model: the contract's dtype (int32 on 0.20.x's shm generation).
DTYPES = {"qwen3_moe_dense": "uint8", "qwen3_moe_wide": "uint16"}


def selected(release: str) -> bool:
    extra = settings.VLLM_ASCEND_ROUTING_TEST_TRAINER_RELEASES.split()
    return release == FULL_RELEASE or release in extra or "all" in extra


TRAINERS = settings.VLLM_ASCEND_ROUTING_TEST_TRAINER_PYTHONS.split()


@pytest.fixture(scope="module")
def handoff(scenario: Any, tmp_path_factory: pytest.TempPathFactory, generation: str) -> dict[str, dict[str, Any]]:
    """One engine per model writes its arrays (the scenario's verdict per model)."""
    release = distributed.vllm_release()
    if generation == "shm":
        pytest.skip(
            f"vLLM {release} (0.20.x) has no routed_experts_prompt_start and verl 0.9.1 refuses vLLM < 0.22; "
            "the bridge's int32 rows are tested in tests/test_replay.py and tests/test_replay_megatron.py"
        )
    if not selected(release):
        pytest.skip(
            f"trainer hand-off runs on vLLM {FULL_RELEASE} in make test; on {release}: "
            f'{RELEASES_VARIABLE}="{release}" (see this module\'s docstring)'
        )
    out = tmp_path_factory.mktemp("verl_handoff")
    return {arch: scenario("verl-handoff", "--arch", arch, "--out", str(out)) for arch in verl_handoff.ARCHITECTURES}


RESULTS: dict[tuple[str, int], dict[str, Any]] = {}


def trainer_result(python: str, tp: int, handoff: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """verl_replay's RESULT in trainer ``python`` at ``tp`` (run once per module); ``tp`` 0: bridge_replay's."""
    if (python, tp) not in RESULTS:
        if tp:
            cmd = [python, "-m", "tests.harness.verl_replay", "--tp", str(tp)]
        else:
            cmd = [python, "-m", "tests.harness.bridge_replay"]
        cmd += [result["dir"] for result in handoff.values()]
        # From $HOME, the checkout root on PYTHONPATH: the harness is no part of the installed package, and the
        # root must come before site-packages, where verl installs a top-level ``tests`` package of its own.
        env = pythonpath(dict(os.environ))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TRAINER_TIMEOUT_S, cwd=Path.home(), env=env)
        output = proc.stdout + proc.stderr
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}")
        RESULTS[(python, tp)] = json.loads(lines[-1].removeprefix("RESULT "))
    return RESULTS[(python, tp)]


def test_vllm_arrays_exact(handoff: dict[str, dict[str, Any]], generation: str) -> None:
    """What the trainer gets is right to begin with: every row as the reference routes it, the contract's dtype,
    with rows from token 0 and from ``routed_experts_prompt_start``."""
    for arch, result in handoff.items():
        assert result["ok"], result["problems"]
        assert result["rows"] == result["matched"] > 0
        started = result["started"]
        assert started["ok"], started["problems"]
        assert started["rows"] == started["matched"] > 0
        assert [shape[0] for shape in started["shapes"]] == [
            prompt + output - 1 - started["prompt_start"] for _, prompt, output in verl_handoff.SHAPES
        ]
        dtype = "int32" if generation == "shm" else DTYPES[arch]
        assert {request["dtype"] for request in result["requests"]} == {dtype}
        for request, (_, prompt, output) in zip(result["requests"], verl_handoff.SHAPES, strict=True):
            assert request["array_shape"][0] == prompt + output - 1  # row t = token t, no row for the last
        checked = result["sentinel"]
        assert checked["rows_checked"] > 0 and checked["zero_rows"] == 0 and checked["invalid_ids"] == 0, checked


@pytest.mark.parametrize("tp", TENSOR_PARALLEL, ids=lambda tp: f"tp{tp}")
@pytest.mark.parametrize("python", TRAINERS, ids=lambda python: Path(python).parents[1].name)
def test_verl_replays_every_recorded_row(
    handoff: dict[str, dict[str, Any]], generation: str, python: str, tp: int
) -> None:
    result = trainer_result(python, tp, handoff)
    where = f"Megatron-Core {result['megatron_core']}, verl {result['verl']}, Python {result['python']}, TP {tp}"
    discriminating = 0
    for model in result["models"]:
        dtype = "int32" if generation == "shm" else DTYPES[model["arch"]]
        assert model["dtypes"] == [dtype], f"{model['arch']}: verl got {model['dtypes']}, vLLM returns {dtype}"
        assert len(model["micro_batches"]) > 1, "verl's dynamic batch size should have regrouped the requests"
        assert model["as_dict_agrees"], f"{model['arch']}: AgentLoopOutput.as_dict places the rows elsewhere"
        for shape in model["shapes"]:
            moe = shape["moe_layers"]
            length = shape["prompt_len"] + shape["output_len"]
            padding = (-length) % tp  # verl pads each sequence to a multiple of TP x CP (CP = 1 here)
            for name in ("forward", "backward"):
                counts = shape[name]
                print(
                    f"{model['arch']} | {shape['dtype']} | {shape['shape_name']} ({shape['prompt_len']}+"
                    f"{shape['output_len']}) | {name} | right {counts['right']}/{shape['recorded_rows']} | "
                    f"wrong {counts['wrong']} | native {counts['native_last']}+{counts['native_padding']} | {where}"
                )
                label = f"{model['arch']} {shape['shape_name']} {name} ({where})"
                assert counts["wrong"] == 0, f"{label}: {counts['problems']}"
                assert counts["right"] == shape["recorded_rows"] == (length - 1) * moe > 0, label
                # Native rows: exactly the last token and verl's padding, in each MoE layer.
                assert counts["native_last"] == moe and counts["native_padding"] == padding * moe, label
                discriminating += counts["discriminating"]
    assert discriminating > 0, "the drawn logits route like vLLM everywhere: the test could not fail"


@pytest.mark.parametrize("python", TRAINERS, ids=lambda python: Path(python).parents[1].name)
def test_bridge_recipe_replays_recorded_rows_and_keeps_the_rest_native(
    handoff: dict[str, dict[str, Any]], python: str
) -> None:
    """docs/training.md's recipe (align, to_megatron, set_model_targets) on the same arrays, rows from token 0 and
    from prompt_start = 3, on stock Megatron-Core's RouterReplay (the bridge's keep_native) and on verl's
    (its replay_mask): every recorded row replayed as the reference routes it, every other row (before
    prompt_start, each last token, the padding) on the router's own top-k; the shift check passes the rows as
    vLLM returned them and refuses them one token late, naming the convention."""
    result = trainer_result(python, 0, handoff)
    where = f"Megatron-Core {result['megatron_core']}, Python {result['python']}"
    pad_to = result["pad_to"]
    forms = set()
    for run in result["runs"]:
        start, requests, moe = run["prompt_start"], run["requests"], run["moe_layers"]
        recorded = sum(r["prompt_len"] + r["output_len"] - 1 - start for r in requests)
        assert [r["rows"] for r in requests] == [r["prompt_len"] + r["output_len"] - 1 - start for r in requests]
        padded = sum(-(-(r["prompt_len"] + r["output_len"]) // pad_to) * pad_to for r in requests)
        print(
            f"{run['arch']} | {run['form']} | prompt_start {start} | replayed {run['replayed']} | native "
            f"{run['native']} | wrong {run['wrong']} | {where}"
            + (f" | agreement {run['shift']['agreement']:.3f}" if "shift" in run else "")
        )
        label = f"{run['arch']} {run['form']} prompt_start={start} ({where})"
        assert run["wrong"] == 0, f"{label}: {run['problems']}"
        assert run["replayed"] == 2 * moe * recorded, label  # forward and recompute
        assert run["native"] == 2 * moe * (padded - recorded), label
        assert run["discriminating"] > 0, f"{label}: the drawn logits route like vLLM: the test could not fail"
        if run["form"] == "stock":
            assert run["shift"]["agreement"] > 0.95, label
            assert "row t must be token t" in run["shift"]["shift_refused"], label
        forms.add((run["form"], start))
    assert forms == {(form, start) for form in ("stock", "verl") for start in (0, verl_handoff.PROMPT_START)}
