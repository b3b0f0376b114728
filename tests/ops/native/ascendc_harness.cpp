// SPDX-License-Identifier: Apache-2.0
// Runs the AscendC record_topk_ids kernel source on the CPU under the emulation in ascendc_emulation/,
// launched exactly as the torch_npu binding launches it (same tiling header), one core after another.
//
// GM is modelled as device allocations: each tensor is copied into its own 512-byte aligned buffer (as the
// NPU allocator returns), registered with the emulation under its name and size (inputs read-only), with
// guard bytes on both sides that must be intact after the launch. Every violation, including a core leaving
// a queue unbalanced or never writing its error count, comes back as status 1 and a message, never a crash.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "record_topk_ids_kernel.cpp"
#include "record_topk_ids_tiling.h"

namespace {

constexpr int64_t kGmAlign = 512;  // alignment of NPU device allocations
constexpr int64_t kGuardBytes = 512;
constexpr uint8_t kGuardByte = 0xCD;

// One device-like GM allocation holding a copy of a host tensor.
class GmBuffer {
 public:
  GmBuffer(const char* name, const void* host, int64_t bytes, bool writable)
      : name_(name), bytes_(bytes), storage_(static_cast<size_t>(bytes + 2 * kGuardBytes + kGmAlign), kGuardByte) {
    const uintptr_t raw = reinterpret_cast<uintptr_t>(storage_.data()) + kGuardBytes;
    data_ = reinterpret_cast<uint8_t*>((raw + kGmAlign - 1) / kGmAlign * kGmAlign);
    if (bytes > 0) std::memcpy(data_, host, static_cast<size_t>(bytes));
    AscendC::emulation::register_gm(name, data_, bytes, writable);
  }
  uint8_t* data() const { return data_; }

  // A store that bypassed the emulated copies (or a check missing from them) shows up here.
  void check_guards() const {
    for (int64_t i = 1; i <= kGuardBytes; ++i) {
      if (data_[-i] != kGuardByte || data_[bytes_ + i - 1] != kGuardByte) {
        throw std::logic_error("AscendC emulation: guard bytes around GM '" + name_ + "' were overwritten");
      }
    }
  }
  void copy_to(void* host) const {
    if (bytes_ > 0) std::memcpy(host, data_, static_cast<size_t>(bytes_));
  }

 private:
  std::string name_;
  int64_t bytes_;
  std::vector<uint8_t> storage_;
  uint8_t* data_ = nullptr;
};

}  // namespace

ASCENDC_EMULATION_EXPORT int run_record_topk_ids(const int32_t* topk_ids, int16_t* out, int64_t num_tokens,
                                                 int64_t top_k, int64_t num_rows, int64_t num_layers, int64_t layer_id,
                                                 int64_t num_experts, int64_t max_cores, int64_t* errors, char* message,
                                                 int64_t message_len) {
  namespace vr = vllm_ascend_routing;
  namespace em = AscendC::emulation;
  const vr::RecordTiling tiling = vr::MakeRecordTiling(num_tokens, top_k, num_layers, layer_id, num_experts);
  const uint32_t block_dim = vr::RecordBlockDim(num_tokens, max_cores, tiling);
  // Each core's slot is poisoned: every core must write its count; the padding between slots stays 0.
  constexpr int32_t kUnwritten = -7;
  std::vector<int32_t> errors_host(block_dim * vr::kErrorsStride, 0);
  for (uint32_t core = 0; core < block_dim; ++core) errors_host[core * vr::kErrorsStride] = kUnwritten;
  const int64_t out_bytes = num_rows * num_layers * top_k * vr::kOutBytes;
  int64_t running = -1;  // core being run, for the message
  try {
    em::begin_launch();
    std::vector<GmBuffer> gm;
    gm.reserve(3);
    gm.emplace_back("topk_ids", topk_ids, num_tokens * top_k * 4, false);
    gm.emplace_back("out", out, out_bytes, true);
    gm.emplace_back("errors_ws", errors_host.data(), static_cast<int64_t>(errors_host.size() * 4), true);
    GM_ADDR ids_gm = gm[0].data();
    GM_ADDR out_gm = gm[1].data();
    GM_ADDR ws_gm = gm[2].data();
    for (uint32_t block = 0; block < block_dim; ++block) {
      running = block;
      em::begin_core(block, block_dim);
      record_topk_ids_int16(ids_gm, out_gm, ws_gm, tiling);
      em::end_core();
    }
    running = -1;
    for (const GmBuffer& buffer : gm) buffer.check_guards();
    gm[1].copy_to(out);
    gm.back().copy_to(errors_host.data());
    em::end_launch();
  } catch (const std::exception& e) {
    em::end_launch();
    const std::string where = running >= 0 ? "core " + std::to_string(running) + " of " +
                                                 std::to_string(block_dim) + ": "
                                           : "";
    std::strncpy(message, (where + e.what()).c_str(), static_cast<size_t>(message_len - 1));
    message[message_len - 1] = '\0';
    return 1;
  }
  int64_t total = 0;
  for (uint32_t core = 0; core < block_dim; ++core) {
    if (errors_host[core * vr::kErrorsStride] == kUnwritten) {
      const std::string what = "AscendC emulation: core " + std::to_string(core) + " never wrote its error count";
      std::strncpy(message, what.c_str(), static_cast<size_t>(message_len - 1));
      message[message_len - 1] = '\0';
      return 1;
    }
  }
  for (int32_t count : errors_host) total += count;
  *errors = total;
  return 0;
}
