# SPDX-License-Identifier: Apache-2.0
"""Tiny MoE models, the transformers reference, and the exact comparison: used by demo, tests, benchmarks."""
