// SPDX-License-Identifier: Apache-2.0
// record_topk_ids on the host: the rows of one layer written in one pass, range check and store fused.
//
// Token i's K ids go to out[i, k] of one layer's [R, K] view (strided: the capture buffer is [R, L, K]). With a
// limit, this implements the op's invalid-id rule (vllm_ascend_routing/ops/_id_rule.py): an id outside
// [0, limit) is stored as kInvalidId (-1) and counted. Viewed as unsigned, a negative id is huge, so one
// comparison decides. No torch or Python headers: the torch binding and the direct entry both call it.
#pragma once

#include <cstdint>

namespace vllm_ascend_routing::cpu {

// The invalid-id rule's constants (ops/_id_rule.py: INVALID_ID, STORAGE_LIMIT).
constexpr int16_t kInvalidId = -1;
constexpr int64_t kStorageLimit = 32767;

// Strides are in elements. limit < 0: no range check, ids narrowed as Tensor.copy_ narrows them.
struct Rows {
  int64_t num_tokens;
  int64_t top_k;
  int64_t ids_row_stride;
  int64_t ids_slot_stride;
  int64_t out_row_stride;
  int64_t out_slot_stride;
  int64_t limit;
};

// Writes the rows and returns how many ids were invalid (0 without a limit). Compiled once per x86 vector
// width with a run-time choice (record_topk_ids_rows.cpp): the narrowing store vectorises only past SSE2.
int64_t RecordRows(const int32_t* ids, int16_t* out, const Rows& rows);
int64_t RecordRows(const int64_t* ids, int16_t* out, const Rows& rows);

}  // namespace vllm_ascend_routing::cpu
