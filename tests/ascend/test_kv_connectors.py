# SPDX-License-Identifier: Apache-2.0
"""vllm-ascend's own KV connectors, as this release registers them (read from its source): every one it registers
from its ``kv_p2p`` package (P/D hand-over between instances) is refused by name; every other (``kv_pool``: stores
and offload tiers; its ``MultiConnector``) is served, rows of KV the instance computed held in its scheduler. A new
P/D connector in a later release fails here until it is classified."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.ascend.conftest import ASCEND_SRC
from vllm_ascend_routing import kv

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

_REGISTERED = re.compile(r'register_connector\(\s*"(\w+)",\s*"([\w.]+)"')


def registered() -> dict[str, str]:
    """Connector name -> the module vllm-ascend registers it from."""
    root = Path(ASCEND_SRC.split(":")[0]) / "vllm_ascend"
    found: dict[str, str] = {}
    for path in root.rglob("*.py"):
        found.update(_REGISTERED.findall(path.read_text(errors="ignore")))
    return found


def config(name: str) -> object:
    return type("KVTransferConfig", (), {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": {}})


def test_vllm_ascend_p2p_connectors_are_refused_and_its_stores_served() -> None:
    connectors = registered()
    assert connectors, "no register_connector call found in vllm-ascend's source"
    wrong = {name: module for name, module in connectors.items() if kv.serves(config(name)) == (".kv_p2p." in module)}
    assert not wrong, f"classified wrongly (kv_p2p must be refused, the rest served): {wrong}"
    refused = sorted(name for name, module in connectors.items() if ".kv_p2p." in module)
    served = sorted(name for name in connectors if name not in refused)
    assert refused and served
    print(f"refused: {', '.join(refused)}; served: {', '.join(served)}")
