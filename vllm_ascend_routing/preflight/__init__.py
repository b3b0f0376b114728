# SPDX-License-Identifier: Apache-2.0
"""What doctor, demo and replay-check run: tiny MoE models, the transformers reference, the exact comparison, the
offline scenario, and replay-check's transformers trainer (tests and benchmarks use them too; the test harness
itself lives in the checkout's ``tests/harness``, outside the installed package)."""
