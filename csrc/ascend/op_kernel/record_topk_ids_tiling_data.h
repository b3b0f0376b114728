// SPDX-License-Identifier: Apache-2.0
// Tiling data passed by value from the host to the record_topk_ids AscendC kernel.
#pragma once

#include <cstdint>

namespace vllm_ascend_routing {

// int32 slots between two cores' error counts in the workspace: one 32-byte block each.
constexpr int64_t kErrorsStride = 8;

// The invalid-id rule's constants (vllm_ascend_routing/ops/_id_rule.py: INVALID_ID, STORAGE_LIMIT).
constexpr int32_t kInvalidId = -1;        // stored instead of an out-of-range id
constexpr int64_t kStorageLimit = 32767;  // the most ids int16 records as valid (0 .. 32766)

struct RecordTiling {
  int64_t num_tokens;   // N
  int64_t top_k;        // K
  int64_t num_layers;   // L
  int64_t layer_id;
  int64_t limit;        // ids must lie in [0, limit); < 0: no check
  int64_t tile_tokens;  // T
};

}  // namespace vllm_ascend_routing
