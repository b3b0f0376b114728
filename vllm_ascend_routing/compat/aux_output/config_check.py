# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.31+'s AuxOutput config check (``VllmConfig._verify_aux_output_compatibility``), where the plugin serves
what it refuses; every other condition of the check still applies (MoE model, prefix caching, no PP/DCP/PCP, no
adaptive speculative verification, the P/D connectors the plugin does not carry rows for).

  * It refuses in-tree platforms without Model Runner V2 (which needs Triton: never on the CPU build), and exempts
    out-of-tree platforms, which drive the connector from their own runners. On the CPU the plugin drives it from
    the V1 runner the same way (``adapter``): there, and only at that check, ``Platform.is_out_of_tree`` answers
    true.
  * It refuses routed experts with NIXL, whose loaded rows the plugin carries (``kv.lifts``): at that check only,
    ``KVTransferConfig.has_connector`` does not name it.

Both through the one lifting helper (``compat/_lift.py``): every other reader of the platform or the KV config
gets vLLM's own answer. A draft model's copy of the config (vLLM builds one for the drafter) is not checked: the
target's runner drives the connector.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_ascend_routing import kv, patching
from vllm_ascend_routing.compat import _lift
from vllm_ascend_routing.compat._lift import Site
from vllm_ascend_routing.compat.interface import Generation
from vllm_ascend_routing.patching import Patch

_AUX = (Generation.AUX_OUTPUT,)
_REMOVE = "vLLM's CPU build runs Model Runner V2 and vLLM carries aux outputs through KV connectors itself"
CONFIG_CHECK = Patch(
    "vllm.config.vllm:VllmConfig._verify_aux_output_compatibility",
    "not run on the drafter's copy of the config where the plugin drives the connector (the target's runner does)",
    _REMOVE,
    _AUX,
    ("self",),
)
OUT_OF_TREE = Patch(
    "vllm.platforms.interface:Platform.is_out_of_tree",
    "at vLLM's AuxOutput check only: true on the CPU, whose V1 runner the plugin drives as out-of-tree platforms "
    "drive theirs",
    _REMOVE,
    _AUX,
    ("self",),
)
HAS_CONNECTOR = Patch(
    "vllm.config.kv_transfer:KVTransferConfig.has_connector",
    "at vLLM's AuxOutput check only: false for the connectors whose loaded rows the plugin carries (NIXL)",
    _REMOVE,
    _AUX,
    ("self", "connector_name"),
)
PATCHES = (CONFIG_CHECK, OUT_OF_TREE, HAS_CONNECTOR)


def install() -> None:
    patching.replace(CONFIG_CHECK, _skipping_the_drafter)
    patching.replace(OUT_OF_TREE, lambda read: _lift.lifted(read, check_site, _driven_here))
    patching.replace(HAS_CONNECTOR, lambda read: _lift.lifted(read, check_site, _carried))


@functools.cache
def check_site() -> Site | None:
    """vLLM's own check (the code of the method the plugin's replacement wraps)."""
    try:
        check = patching.original_of(patching.resolve(CONFIG_CHECK.target))
    except LookupError:
        return None
    code = getattr(check, "__code__", None)
    return None if code is None else Site(code)


def drives_connector(config: Any, platform: Any) -> bool:
    """Whether the plugin drives vLLM's AuxOutput connector for ``config``: on the CPU, from the V1 runner."""
    return bool(platform.is_cpu() and config.aux_output_config.enabled and not config.use_v2_model_runner)


def _driven_here(config: Any, platform: Any, value: bool) -> Any:
    return True if config is not None and drives_connector(config, platform) else _lift.NOT_LIFTED


def _carried(config: Any, kv_config: Any, value: bool, name: str = "") -> Any:
    return False if value and kv.lifts(kv_config, name) else _lift.NOT_LIFTED


def _skipping_the_drafter(verify: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(verify)
    def verify_aux_output_compatibility(self: Any) -> None:
        from vllm.platforms import current_platform

        if drives_connector(self, current_platform) and getattr(self.model_config, "runner_type", None) == "draft":
            return None  # the draft model's copy of the target's config: the target's runner drives the connector
        return verify(self)

    return verify_aux_output_compatibility
