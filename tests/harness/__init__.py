# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY harness: the scenarios the end-to-end tests run in subprocesses (serving, speculative decoding, data
parallel, distributed, stress, bypass, trainer hand-off), the stand-ins they put on engine processes'
``PYTHONPATH`` (the ``*_standin/sitecustomize.py`` folders) and the CPU-kernel probe. None of it is in the
installed package (the wheel holds only what doctor, demo and replay-check run: ``vllm_ascend_routing.preflight``),
so every process it starts gets the checkout root on ``PYTHONPATH`` (``pythonpath``) to import ``tests.harness``.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the folder holding tests/ and vllm_ascend_routing/


def pythonpath(env: dict[str, str], *first: Path) -> dict[str, str]:
    """``env`` with ``first`` (stand-in folders), then the checkout root, leading its ``PYTHONPATH``.

    The root goes before site-packages, not after: a trainer environment's verl installs a top-level ``tests``
    package of its own, which would otherwise be the ``tests`` imported. The checkout's ``vllm_ascend_routing``
    then comes first too; ``scripts/venv.py`` keeps the environments' installed copy the same sources.
    """
    entries = [str(path) for path in (*first, ROOT)]
    kept = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in entries]
    env["PYTHONPATH"] = os.pathsep.join(entries + kept)
    return env


# Every process of the harness builds the suite's models by name: their recipes are registered with the runtime's
# builder (which holds only the doctor's) as the harness is imported.
from tests.harness import model_recipes  # noqa: E402,F401
