# SPDX-License-Identifier: Apache-2.0
"""Build logic only. Metadata lives in pyproject.toml.

A native kernel is built only when ``VLLM_ASCEND_ROUTING_TARGET_DEVICE`` names one (read through
``vllm_ascend_routing/envs.py``, loaded by path). Otherwise the package is pure Python.
"""

import importlib.util
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _envs():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("_envs", ROOT / "vllm_ascend_routing" / "envs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


target = _envs().VLLM_ASCEND_ROUTING_TARGET_DEVICE
if target not in ("", "empty"):
    raise SystemExit(
        f"VLLM_ASCEND_ROUTING_TARGET_DEVICE={target}: native kernels are not part of this version of "
        "vllm-ascend-routing; unset it to install the pure-Python package (PyTorch reference kernel)."
    )

setup()
