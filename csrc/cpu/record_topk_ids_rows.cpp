// SPDX-License-Identifier: Apache-2.0
// The loops of record_topk_ids_rows.h. The capture's common case is a [N, K] block of ids into the strided layer
// view of the [R, L, K] buffer: N runs of K ids, K one of a few top-k values (1, 2, 4, 6, 8, 10, 16 in today's MoE
// models); with K known at compile time each run is one or two vector operations (compare, select, narrow, store).
#include "record_topk_ids_rows.h"

#include <type_traits>

// x86-64's baseline (SSE2) has no unsigned compare and no truncating int32 -> int16 pack, so the compiler leaves
// the loop scalar; one clone per wider ISA, picked once at load time (an ifunc), costs nothing per call.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VLLM_ASCEND_ROUTING_CPU_CLONES __attribute__((target_clones("avx2", "sse4.1", "default")))
#else
#define VLLM_ASCEND_ROUTING_CPU_CLONES
#endif
// The loops must be compiled inside each clone, for its ISA: inlined always, never called out of line.
#if defined(__GNUC__) || defined(__clang__)
#define VLLM_ASCEND_ROUTING_INLINE inline __attribute__((always_inline))
#else
#define VLLM_ASCEND_ROUTING_INLINE inline
#endif

namespace vllm_ascend_routing::cpu {
namespace {

// One run of `count` ids at unit stride.
template <typename IdT>
VLLM_ASCEND_ROUTING_INLINE int64_t record_run(const IdT* src, int16_t* dst, int64_t count, int64_t limit) {
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

// N runs of a compile-time K, one every row stride. The fields are read into locals first: stores into `out`
// could otherwise alias `r` for the compiler, which would reload them (and re-test the limit) every row.
template <int64_t K, typename IdT>
VLLM_ASCEND_ROUTING_INLINE int64_t record_runs(const IdT* ids, int16_t* out, const Rows& r) {
  const int64_t n = r.num_tokens, ids_stride = r.ids_row_stride, out_stride = r.out_row_stride, limit = r.limit;
  int64_t invalid = 0;
  if (limit < 0) {
    for (int64_t i = 0; i < n; ++i) record_run(ids + i * ids_stride, out + i * out_stride, K, -1);
    return 0;
  }
  for (int64_t i = 0; i < n; ++i) invalid += record_run(ids + i * ids_stride, out + i * out_stride, K, limit);
  return invalid;
}

template <typename IdT>
VLLM_ASCEND_ROUTING_INLINE int64_t record_rows(const IdT* ids, int16_t* out, const Rows& r) {
  if (r.ids_slot_stride == 1 && r.out_slot_stride == 1) {
    if (r.ids_row_stride == r.top_k && r.out_row_stride == r.top_k) {  // both dense: one run
      return record_run(ids, out, r.num_tokens * r.top_k, r.limit);
    }
    switch (r.top_k) {
      case 1: return record_runs<1>(ids, out, r);
      case 2: return record_runs<2>(ids, out, r);
      case 4: return record_runs<4>(ids, out, r);
      case 6: return record_runs<6>(ids, out, r);
      case 8: return record_runs<8>(ids, out, r);
      case 10: return record_runs<10>(ids, out, r);
      case 16: return record_runs<16>(ids, out, r);
      default: break;
    }
    int64_t invalid = 0;
    for (int64_t i = 0; i < r.num_tokens; ++i) {
      invalid += record_run(ids + i * r.ids_row_stride, out + i * r.out_row_stride, r.top_k, r.limit);
    }
    return invalid;
  }
  // Any other strides (transposed ids, a permuted buffer): element by element.
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

}  // namespace

VLLM_ASCEND_ROUTING_CPU_CLONES int64_t RecordRows(const int32_t* ids, int16_t* out, const Rows& rows) {
  return record_rows(ids, out, rows);
}

VLLM_ASCEND_ROUTING_CPU_CLONES int64_t RecordRows(const int64_t* ids, int16_t* out, const Rows& rows) {
  return record_rows(ids, out, rows);
}

}  // namespace vllm_ascend_routing::cpu
