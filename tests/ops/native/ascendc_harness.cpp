// SPDX-License-Identifier: Apache-2.0
// Runs the AscendC record_topk_ids kernel source on the CPU under the emulation in ascendc_emulation/,
// launched exactly as the torch_npu binding launches it (same tiling header), one core after another.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "record_topk_ids_kernel.cpp"
#include "record_topk_ids_tiling.h"

extern "C" int run_record_topk_ids(const int32_t* topk_ids, const int32_t* rows, void* out, int out_is_uint8,
                                   int64_t num_tokens, int64_t top_k, int64_t num_rows, int64_t num_layers,
                                   int64_t layer_id, int64_t num_experts, int64_t max_cores, int64_t* errors,
                                   char* message, int64_t message_len) {
  namespace vr = vllm_ascend_routing;
  (void)num_rows;
  const vr::RecordTiling tiling = vr::MakeRecordTiling(num_tokens, top_k, num_layers, layer_id, num_experts,
                                                       out_is_uint8 != 0, rows != nullptr);
  const uint32_t block_dim = vr::RecordBlockDim(num_tokens, max_cores, tiling);
  // Each core's slot is poisoned: every core must write its count; the padding between slots stays 0.
  std::vector<int32_t> errors_ws(block_dim * vr::kErrorsStride, 0);
  for (uint32_t core = 0; core < block_dim; ++core) errors_ws[core * vr::kErrorsStride] = -7;
  try {
    AscendC::emulation::begin_launch();
    for (uint32_t block = 0; block < block_dim; ++block) {
      AscendC::emulation::begin_core(block, block_dim);
      auto ids = reinterpret_cast<GM_ADDR>(const_cast<int32_t*>(topk_ids));
      auto row_ptr = reinterpret_cast<GM_ADDR>(const_cast<int32_t*>(rows));
      auto ws = reinterpret_cast<GM_ADDR>(errors_ws.data());
      if (out_is_uint8) {
        record_topk_ids_uint8(ids, row_ptr, reinterpret_cast<GM_ADDR>(out), ws, tiling);
      } else {
        record_topk_ids_int16(ids, row_ptr, reinterpret_cast<GM_ADDR>(out), ws, tiling);
      }
    }
  } catch (const std::exception& e) {
    std::strncpy(message, e.what(), static_cast<size_t>(message_len - 1));
    message[message_len - 1] = '\0';
    return 1;
  }
  int64_t total = 0;
  for (int32_t count : errors_ws) total += count;
  *errors = total;
  return 0;
}
