# SPDX-License-Identifier: Apache-2.0
import random

import pytest

from tests import settings


@pytest.fixture(scope="session")
def run_seed() -> int:
    """Fresh random inputs every run (printed, and reproducible with VLLM_ASCEND_ROUTING_TEST_SEED)."""
    seed = int(settings.VLLM_ASCEND_ROUTING_TEST_SEED or random.randrange(1 << 30))
    print(f"record_topk_ids test seed: {seed}")
    return seed
