# SPDX-License-Identifier: Apache-2.0
"""Against the installed vLLM (release venvs): the CPU compat fix and generation detection."""

from __future__ import annotations

import importlib

import pytest
import torch

from vllm_ascend_routing import _cpu_compat

pytestmark = pytest.mark.vllm


def test_silu_entry_replaced_and_callable_outside_config_context() -> None:
    try:
        cpu_fused_moe = importlib.import_module("vllm.model_executor.layers.fused_moe.cpu_fused_moe")
    except ImportError:
        cpu_fused_moe = None
    table = getattr(cpu_fused_moe, "_CPU_MOE_ACT_FN", None)
    if cpu_fused_moe is None or table is None:  # releases without the faulty table (0.28+)
        assert _cpu_compat.apply() is False
        return
    silu = cpu_fused_moe.MoEActivation.SILU
    original = table[silu]
    x = torch.randn(5, 8)
    if original is not cpu_fused_moe.SiluAndMul.forward_native:
        with pytest.raises(AssertionError, match="config is not set"):  # the crash the fix exists for
            original(x)
    try:
        _cpu_compat.apply()
        assert _cpu_compat.apply() is False  # idempotent: nothing left to change
        # No vLLM config context is set here, exactly as at forward time inside the engine.
        got = table[silu](x)
        torch.testing.assert_close(got, torch.nn.functional.silu(x[:, :4]) * x[:, 4:], rtol=0, atol=0)
    finally:
        table[silu] = original


def test_features_detect_the_generation_of_this_release() -> None:
    import vllm

    from vllm_ascend_routing.compat import Generation, get_api

    minor = int(vllm.__version__.split(".")[1])
    if minor == 20:
        expected = Generation.SHM
    elif minor <= 30:
        expected = Generation.RUNNER_OUTPUT
    else:
        expected = Generation.AUX_OUTPUT
    assert get_api().generation is expected
