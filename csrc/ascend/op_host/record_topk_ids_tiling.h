// SPDX-License-Identifier: Apache-2.0
// Host-side tiling of record_topk_ids for AscendC: shared by the torch_npu binding and the CPU emulation
// test harness, so both launch the kernel exactly the same way.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../op_kernel/record_topk_ids_tiling_data.h"

namespace vllm_ascend_routing {

constexpr int64_t kUnifiedBufferBytes = 192 * 1024;  // UB per AI Core (Atlas A2/A3)
constexpr int64_t kMaxTileTokens = 1024;

inline int64_t RoundUpHost(int64_t value, int64_t unit) { return (value + unit - 1) / unit * unit; }

constexpr int64_t kOutBytes = 2;  // out is int16

inline RecordTiling MakeRecordTiling(int64_t num_tokens, int64_t top_k, int64_t num_layers, int64_t layer_id,
                                     int64_t num_experts) {
  // Per tile token: ids (K int32) + one 32-byte-padded output row, double-buffered.
  const int64_t per_token = 2 * (top_k * 4 + RoundUpHost(top_k * kOutBytes, 32));
  const int64_t fit = (kUnifiedBufferBytes - 4 * 1024) / per_token;  // keep headroom for alignment padding
  RecordTiling tiling{};
  tiling.num_tokens = num_tokens;
  tiling.top_k = top_k;
  tiling.num_layers = num_layers;
  tiling.layer_id = layer_id;
  // The invalid-id rule's limit (ops/_id_rule.py id_limit).
  tiling.limit = num_experts >= 0 ? std::min(num_experts, kStorageLimit) : -1;
  tiling.tile_tokens = std::max<int64_t>(1, std::min<int64_t>(fit, kMaxTileTokens));
  return tiling;
}

// Cores to use: one token at least per core, at most `max_cores`. Two tokens' stores (K values of one
// layer, L*K values apart) can share a 32-byte GM block unless the gap between them, (L-1)*K values, spans
// a whole block; stores are block-granular on some SoCs, so such shapes run on a single core.
inline uint32_t RecordBlockDim(int64_t num_tokens, int64_t max_cores, const RecordTiling& tiling) {
  if ((tiling.num_layers - 1) * tiling.top_k * kOutBytes < 32) return 1;
  return static_cast<uint32_t>(std::max<int64_t>(1, std::min<int64_t>(num_tokens, max_cores)));
}

}  // namespace vllm_ascend_routing
