// SPDX-License-Identifier: Apache-2.0
// record_topk_ids on the host: the rows of one layer written in one pass, range check and store fused.
//
// Token i's K ids go to out[i, k] of one layer's [R, K] view (strided: the capture buffer is [R, L, K]). With a
// limit, this implements the op's invalid-id rule (vllm_ascend_routing/ops/_id_rule.py): an id outside
// [0, limit) is stored as kInvalidId (-1) and counted. Viewed as unsigned, a negative id is huge, so one
// comparison decides. No torch or Python headers: the torch binding and the direct entry both call it.
#pragma once

#include <cstdint>
#include <type_traits>

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

// `count` ids at unit stride; the loop the compiler vectorises (a compare, a select and a narrowing store).
template <typename IdT>
int64_t record_run(const IdT* src, int16_t* dst, int64_t count, int64_t limit) {
  if (limit < 0) {
    for (int64_t e = 0; e < count; ++e) dst[e] = static_cast<int16_t>(src[e]);
    return 0;
  }
  using Unsigned = std::make_unsigned_t<IdT>;
  const Unsigned bound = static_cast<Unsigned>(limit);
  int64_t invalid = 0;
  for (int64_t e = 0; e < count; ++e) {
    const bool valid = static_cast<Unsigned>(src[e]) < bound;
    invalid += !valid;
    dst[e] = valid ? static_cast<int16_t>(src[e]) : kInvalidId;
  }
  return invalid;
}

// Writes the rows and returns how many ids were invalid (0 without a limit).
template <typename IdT>
int64_t record_rows(const IdT* ids, int16_t* out, const Rows& r) {
  if (r.ids_slot_stride == 1 && r.out_slot_stride == 1) {
    if (r.ids_row_stride == r.top_k && r.out_row_stride == r.top_k) {  // both dense: one run
      return record_run(ids, out, r.num_tokens * r.top_k, r.limit);
    }
    int64_t invalid = 0;  // the capture buffer's layer view: a run of K ids per token
    for (int64_t i = 0; i < r.num_tokens; ++i) {
      invalid += record_run(ids + i * r.ids_row_stride, out + i * r.out_row_stride, r.top_k, r.limit);
    }
    return invalid;
  }
  using Unsigned = std::make_unsigned_t<IdT>;
  const Unsigned bound = static_cast<Unsigned>(r.limit);
  int64_t invalid = 0;
  for (int64_t i = 0; i < r.num_tokens; ++i) {
    for (int64_t k = 0; k < r.top_k; ++k) {
      const IdT value = ids[i * r.ids_row_stride + k * r.ids_slot_stride];
      int16_t& stored = out[i * r.out_row_stride + k * r.out_slot_stride];
      if (r.limit < 0) {
        stored = static_cast<int16_t>(value);
        continue;
      }
      const bool valid = static_cast<Unsigned>(value) < bound;
      invalid += !valid;
      stored = valid ? static_cast<int16_t>(value) : kInvalidId;
    }
  }
  return invalid;
}

}  // namespace vllm_ascend_routing::cpu
