# SPDX-License-Identifier: Apache-2.0
"""Patch manifest: every symbol the plugin replaces or relies on in vLLM and vllm-ascend, collected from the
generation's adapter (its runner hooks on its runner classes, its own ``patches``) and from the features of the
registry (``features.FEATURES``: each declares its ``Patch`` rows next to the code; a row that replaces is applied
through ``patching.replace`` with that row), filtered by API generation, platform and the adapter's capabilities,
and verified.

``verify`` runs at start-up with the plugin on (vLLM's targets when the plugin registers, vllm-ascend's
when its runner module is imported): a target that is missing or lost a parameter the plugin relies on
is refused with its name, instead of a hook silently never running (the all-zeros failure). ``doctor``
prints every row it checked. Nothing is patched while the plugin is off.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_ascend_routing import compat, envs
from vllm_ascend_routing.compat import Adapter
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.features import FEATURES, rows_of
from vllm_ascend_routing.patching import RELY, REPLACE, VALIDATION, Patch, problem, resolve
from vllm_ascend_routing.releases import Generation

__all__ = ["Finding", "Patch", "all_patches", "check", "counted", "patches_for", "verify"]


def adapters() -> tuple[type[Adapter], ...]:
    """Each implemented generation's adapter class, oldest first (the release table names them)."""
    return compat.adapter_classes()


def platforms() -> tuple[str, ...]:
    """Every platform device type some generation hooks runner classes on."""
    return tuple(dict.fromkeys(platform for adapter in adapters() for platform in adapter.runner_classes))


def patches_for(generation: Generation, platform: str) -> list[Patch]:
    """The rows that apply to ``generation`` on ``platform``: the adapter's (its runner hooks first, then its own),
    then each feature's (``features.FEATURES``) where the adapter has what the feature needs."""
    adapter = compat.adapter_class(generation)
    if adapter is None:
        return []
    own = adapter.rows(platform) if platform in adapter.runner_classes else []
    return own + [patch for feature in FEATURES for patch in rows_of(feature, adapter, platform)]


def all_patches() -> list[Patch]:
    """Every row of every supported generation and platform, once."""
    rows: dict[str, Patch] = {}
    for adapter in adapters():
        for platform in platforms():
            for patch in patches_for(adapter.generation, platform):
                rows.setdefault(f"{patch.target}|{patch.generations}|{patch.platform}", patch)
    return list(rows.values())


@dataclass(frozen=True)
class Finding:
    """One row checked against the installed release."""

    patch: Patch
    present: bool
    problem: str | None  # None: fine (or an optional target that is absent here)


def enabled_features() -> frozenset[str]:
    return frozenset({VALIDATION}) if envs.VLLM_ASCEND_ROUTING_VALIDATE != "off" else frozenset()


def check(
    generation: Generation, platform: str, package: str | None = None, features: Iterable[str] | None = None
) -> list[Finding]:
    """Check every row of ``generation`` on ``platform`` (of ``package`` only, when given; feature rows only
    for ``features``, default: all) against the installed release."""
    wanted = None if features is None else set(features)
    rows = [
        patch
        for patch in patches_for(generation, platform)
        if (package is None or patch.package == package)
        and (not patch.feature or wanted is None or patch.feature in wanted)
    ]
    findings = [Finding(patch, _present(patch), problem(patch)) for patch in rows]
    # A ``one_of`` group needs one present member: vLLM moved it, the plugin hooks whichever exists.
    groups: dict[str, list[int]] = {}
    for index, finding in enumerate(findings):
        if finding.patch.one_of:
            groups.setdefault(finding.patch.one_of, []).append(index)
    for name, members in groups.items():
        if not any(findings[i].present for i in members):
            first = findings[members[0]]
            targets = " or ".join(findings[i].patch.target for i in members)
            findings[members[0]] = Finding(first.patch, False, f"{name}: none of {targets} exists")
    return findings


def verify(generation: Generation, platform: str, package: str = "vllm") -> list[Finding]:
    """Refuse to start if a target of ``package`` that this generation, platform and the enabled features
    rely on is missing or changed in the installed release; returns the findings otherwise."""
    findings = check(generation, platform, package, enabled_features())
    problems = [finding.problem for finding in findings if finding.problem is not None]
    if problems:
        raise UnsupportedVllmError(
            f"vllm-ascend-routing: {package} {_version(package)} changed what the plugin patches "
            f"(API generation {generation.value}, platform {platform}):\n  - "
            + "\n  - ".join(problems)
            + "\nThis release is not supported yet: pin a supported one (README, 'Supported releases') or "
            "unset VLLM_ASCEND_ROUTING."
        )
    return findings


def counted(findings: list[Finding]) -> str:
    """``"8 patch targets + 4 relied-on symbols verified (4 optional absent here)"``: what ``findings`` found
    present, the symbols the plugin replaces apart from those it only relies on (``Patch.action``). An absent
    one is optional (another release's location of a moved symbol): ``verify`` refused the others."""
    found = [finding for finding in findings if finding.present]
    patched = sum(finding.patch.action == REPLACE for finding in found)
    relied = sum(finding.patch.action == RELY for finding in found)
    absent = len(findings) - len(found)
    text = f"{patched} patch targets + {relied} relied-on symbols verified"
    return text + (f" ({absent} optional absent here)" if absent else "")


def _present(patch: Patch) -> bool:
    try:
        resolve(patch.target)
    except LookupError:
        return False
    return True


def _version(package: str) -> str:
    from importlib import metadata

    for distribution in (package.replace("_", "-"), f"{package}-cpu".replace("_", "-")):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    try:
        module = importlib.import_module(package)
    except ImportError:
        return "(not importable)"
    return str(getattr(module, "__version__", "(unknown version)"))
