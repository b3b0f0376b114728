// SPDX-License-Identifier: Apache-2.0
// A small host emulation of exactly the AscendC primitives record_topk_ids_kernel.cpp uses, so the
// kernel source compiles with g++ and runs on the CPU. It models what the kernel relies on, and checks
// the rules a real AI Core enforces that the kernel must respect:
//   * the Unified Buffer is a fixed 192 KiB arena per core; TPipe::InitBuffer fails beyond it;
//   * UB buffers start 32-byte aligned; DataCopyPad's UB side must be 32-byte aligned, each UB block of
//     a multi-block copy occupies whole 32-byte units (blockLen rounded up), strides on the UB side are
//     in 32-byte units and on the GM side in bytes;
//   * a TQue holds at most `depth` allocated tensors, DeQue returns them in EnQue order, every
//     AllocTensor is paired with a FreeTensor;
//   * GlobalTensor accesses stay inside the size given to SetGlobalBuffer (when one was given);
//   * within one launch, no two cores store into the same 32-byte GM block (stores are block-granular on
//     some SoCs, so cores sharing a block can overwrite each other's tail).
// Any violation throws std::logic_error with a message, which the test harness reports.
// It is not AscendC: pipeline timing, vector instructions and caches are not modelled.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#define __global__
#define __aicore__
#define __gm__
using GM_ADDR = uint8_t*;

namespace AscendC {

namespace emulation {
constexpr int64_t kUbBytes = 192 * 1024;
constexpr int64_t kBlock = 32;

struct Core {
  int64_t block_idx = 0;
  int64_t block_num = 1;
  std::vector<uint8_t> ub = std::vector<uint8_t>(kUbBytes);
  int64_t ub_used = 0;
};

inline Core& core() {
  static thread_local Core c;
  return c;
}

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::logic_error("AscendC emulation: " + what);
}

// 32-byte GM block -> core that stored into it during the current launch.
inline std::map<uintptr_t, int64_t>& gm_block_owner() {
  static thread_local std::map<uintptr_t, int64_t> owners;
  return owners;
}

// Called by the harness before the first core of a launch.
inline void begin_launch() { gm_block_owner().clear(); }

inline void claim_gm_blocks(const uint8_t* begin, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) / kBlock;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(begin) + bytes - 1) / kBlock;
  for (uintptr_t block = first; block <= last; ++block) {
    auto [it, inserted] = gm_block_owner().emplace(block, core().block_idx);
    require(inserted || it->second == core().block_idx, "two cores store into one 32-byte GM block");
  }
}


inline int64_t ub_offset(const void* p) {
  return static_cast<const uint8_t*>(p) - core().ub.data();
}

// Called by the harness before running one core's kernel body.
inline void begin_core(int64_t idx, int64_t num) {
  core().block_idx = idx;
  core().block_num = num;
  core().ub_used = 0;
  std::memset(core().ub.data(), 0xA5, core().ub.size());  // garbage, like real UB
}
}  // namespace emulation

inline int64_t GetBlockIdx() { return emulation::core().block_idx; }
inline int64_t GetBlockNum() { return emulation::core().block_num; }

enum class QuePosition { VECIN, VECOUT, VECCALC };

template <typename T>
class LocalTensor {
 public:
  LocalTensor() = default;
  LocalTensor(T* data, int64_t size) : data_(data), size_(size) {}
  T GetValue(int64_t i) const {
    emulation::require(i >= 0 && i < size_, "LocalTensor::GetValue out of bounds");
    return data_[i];
  }
  void SetValue(int64_t i, T v) {
    emulation::require(i >= 0 && i < size_, "LocalTensor::SetValue out of bounds");
    data_[i] = v;
  }
  LocalTensor operator[](int64_t offset) const {
    emulation::require(offset >= 0 && offset <= size_, "LocalTensor offset out of bounds");
    return LocalTensor(data_ + offset, size_ - offset);
  }
  T* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  T* data_ = nullptr;
  int64_t size_ = 0;
};

template <typename T>
class GlobalTensor {
 public:
  void SetGlobalBuffer(__gm__ T* data, int64_t size = -1) {
    data_ = data;
    size_ = size;
  }
  GlobalTensor operator[](int64_t offset) const {
    emulation::require(size_ < 0 || (offset >= 0 && offset <= size_), "GlobalTensor offset out of bounds");
    GlobalTensor g;
    g.data_ = data_ + offset;
    g.size_ = size_ < 0 ? -1 : size_ - offset;
    return g;
  }
  T* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  T* data_ = nullptr;
  int64_t size_ = -1;
};

struct DataCopyExtParams {
  DataCopyExtParams(uint16_t count, uint32_t len, uint32_t src, uint32_t dst, uint32_t rsv)
      : blockCount(count), blockLen(len), srcStride(src), dstStride(dst), rsv(rsv) {}
  uint16_t blockCount;
  uint32_t blockLen;   // bytes
  uint32_t srcStride;  // GM side: bytes; UB side: 32-byte units
  uint32_t dstStride;  // GM side: bytes; UB side: 32-byte units
  uint32_t rsv;
};

template <typename T>
struct DataCopyPadExtParams {
  DataCopyPadExtParams(bool pad, uint8_t left, uint8_t right, T value)
      : isPad(pad), leftPadding(left), rightPadding(right), paddingValue(value) {}
  bool isPad;
  uint8_t leftPadding;
  uint8_t rightPadding;
  T paddingValue;
};

// GM -> UB.
template <typename T>
void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                 const DataCopyPadExtParams<T>& pad) {
  emulation::require(!pad.isPad, "padding values are not emulated");
  emulation::require(emulation::ub_offset(dst.data()) % emulation::kBlock == 0, "DataCopyPad: UB dst not 32B aligned");
  const int64_t ub_block = (static_cast<int64_t>(p.blockLen) + emulation::kBlock - 1) / emulation::kBlock * emulation::kBlock;
  const uint8_t* gm = reinterpret_cast<const uint8_t*>(src.data());
  uint8_t* ub = reinterpret_cast<uint8_t*>(dst.data());
  for (int64_t b = 0; b < p.blockCount; ++b) {
    const int64_t gm_off = b * (p.blockLen + p.srcStride);
    const int64_t ub_off = b * (ub_block + p.dstStride * emulation::kBlock);
    emulation::require(src.size() < 0 || gm_off + p.blockLen <= src.size() * static_cast<int64_t>(sizeof(T)),
                       "DataCopyPad: GM read out of bounds");
    emulation::require(ub_off + static_cast<int64_t>(p.blockLen) <= dst.size() * static_cast<int64_t>(sizeof(T)),
                       "DataCopyPad: UB write out of bounds");
    std::memcpy(ub + ub_off, gm + gm_off, p.blockLen);
  }
}

// UB -> GM.
template <typename T>
void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
  emulation::require(emulation::ub_offset(src.data()) % emulation::kBlock == 0, "DataCopyPad: UB src not 32B aligned");
  const int64_t ub_block = (static_cast<int64_t>(p.blockLen) + emulation::kBlock - 1) / emulation::kBlock * emulation::kBlock;
  const uint8_t* ub = reinterpret_cast<const uint8_t*>(src.data());
  uint8_t* gm = reinterpret_cast<uint8_t*>(dst.data());
  for (int64_t b = 0; b < p.blockCount; ++b) {
    const int64_t ub_off = b * (ub_block + p.srcStride * emulation::kBlock);
    const int64_t gm_off = b * (p.blockLen + p.dstStride);
    emulation::require(ub_off + static_cast<int64_t>(p.blockLen) <= src.size() * static_cast<int64_t>(sizeof(T)),
                       "DataCopyPad: UB read out of bounds");
    emulation::require(dst.size() < 0 || gm_off + p.blockLen <= dst.size() * static_cast<int64_t>(sizeof(T)),
                       "DataCopyPad: GM write out of bounds");
    emulation::claim_gm_blocks(gm + gm_off, p.blockLen);
    std::memcpy(gm + gm_off, ub + ub_off, p.blockLen);
  }
}

class TPipe;

template <QuePosition Pos, int32_t Depth>
class TQue {
 public:
  template <typename T>
  LocalTensor<T> AllocTensor() {
    emulation::require(!free_.empty(), "TQue::AllocTensor beyond the queue depth");
    const int64_t slot = free_.front();
    free_.pop_front();
    return LocalTensor<T>(reinterpret_cast<T*>(base_ + slot * bytes_), bytes_ / static_cast<int64_t>(sizeof(T)));
  }
  template <typename T>
  void EnQue(const LocalTensor<T>& t) {
    queued_.push_back(slot_of(t.data()));
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    emulation::require(!queued_.empty(), "TQue::DeQue on an empty queue");
    const int64_t slot = queued_.front();
    queued_.pop_front();
    return LocalTensor<T>(reinterpret_cast<T*>(base_ + slot * bytes_), bytes_ / static_cast<int64_t>(sizeof(T)));
  }
  template <typename T>
  void FreeTensor(const LocalTensor<T>& t) {
    free_.push_back(slot_of(t.data()));
  }

 private:
  friend class TPipe;
  int64_t slot_of(const void* p) const {
    const int64_t off = static_cast<const uint8_t*>(p) - base_;
    emulation::require(off >= 0 && off % bytes_ == 0 && off / bytes_ < Depth, "tensor does not belong to this TQue");
    return off / bytes_;
  }
  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
  std::deque<int64_t> free_;
  std::deque<int64_t> queued_;
};

template <QuePosition Pos>
class TBuf {
 public:
  template <typename T>
  LocalTensor<T> Get() {
    return LocalTensor<T>(reinterpret_cast<T*>(base_), bytes_ / static_cast<int64_t>(sizeof(T)));
  }

 private:
  friend class TPipe;
  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
};

class TPipe {
 public:
  template <QuePosition Pos, int32_t Depth>
  void InitBuffer(TQue<Pos, Depth>& que, int32_t num, int64_t bytes) {
    emulation::require(num <= Depth, "InitBuffer: more buffers than the queue depth");
    que.base_ = take(num * round(bytes));
    que.bytes_ = round(bytes);
    for (int32_t i = 0; i < num; ++i) que.free_.push_back(i);
  }
  template <QuePosition Pos>
  void InitBuffer(TBuf<Pos>& buf, int64_t bytes) {
    buf.base_ = take(round(bytes));
    buf.bytes_ = round(bytes);
  }

 private:
  static int64_t round(int64_t bytes) { return (bytes + emulation::kBlock - 1) / emulation::kBlock * emulation::kBlock; }
  static uint8_t* take(int64_t bytes) {
    emulation::Core& c = emulation::core();
    emulation::require(c.ub_used + bytes <= emulation::kUbBytes, "Unified Buffer overflow (192 KiB per core)");
    uint8_t* p = c.ub.data() + c.ub_used;
    c.ub_used += bytes;
    return p;
  }
};

}  // namespace AscendC
