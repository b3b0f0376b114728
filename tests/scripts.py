# SPDX-License-Identifier: Apache-2.0
"""Load a file from ``scripts/`` or ``benchmarks/`` (folders that are no package) as a module for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load(relative_path: str, module_name: str) -> ModuleType:
    """Import ``ROOT / relative_path`` as ``module_name``; registered in sys.modules so its dataclasses,
    TypedDicts and NamedTuples resolve their own module."""
    spec = importlib.util.spec_from_file_location(module_name, ROOT / relative_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
