# SPDX-License-Identifier: Apache-2.0
"""The shared error types live in the leaf ``errors`` and stay importable where they were public."""

from __future__ import annotations

from vllm_ascend_routing import compat, errors
from vllm_ascend_routing.compat import interface as base


def test_unsupported_vllm_error_is_one_class_wherever_it_is_imported() -> None:
    assert compat.UnsupportedVllmError is base.UnsupportedVllmError is errors.UnsupportedVllmError
    assert "UnsupportedVllmError" in compat.__all__ and "UnsupportedVllmError" in base.__all__
