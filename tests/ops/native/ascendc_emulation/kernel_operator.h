// SPDX-License-Identifier: Apache-2.0
// A small host emulation of the AscendC primitives record_topk_ids_kernel.cpp uses (plus DataCopy and
// GlobalTensor Get/SetValue, so that plausible mistakes in the kernel still compile and get caught), so the
// kernel source compiles with g++ and runs on the CPU. It models what the kernel relies on, and checks the
// rules a real AI Core enforces that the kernel must respect:
//   * the Unified Buffer is a fixed 192 KiB arena per core; TPipe::InitBuffer fails beyond it;
//   * UB buffers start 32-byte aligned; DataCopyPad's UB side must be 32-byte aligned, each UB block of
//     a multi-block copy occupies whole 32-byte units (blockLen rounded up), strides on the UB side are
//     in 32-byte units and on the GM side in bytes, blockCount is at most 4095; DataCopy (no padding)
//     needs a 32-byte aligned UB side and a length that is a whole number of 32-byte blocks;
//   * GM is what the launcher registered (register_gm): every GlobalTensor must point into a registered
//     buffer, and every read AND write (DataCopy, DataCopyPad, Get/SetValue) must stay inside both that
//     buffer and the size given to SetGlobalBuffer (when one was given); inputs are registered read-only;
//   * a TQue hands out at most `num` buffers and holds at most `Depth` of them enqueued; each tensor goes
//     AllocTensor -> [EnQue -> DeQue] -> FreeTensor; freeing twice, freeing while enqueued, touching a
//     tensor after FreeTensor or while it is enqueued fail; at kernel end (end_core) every tensor must have
//     been freed and every EnQue matched by a DeQue (TBuf tensors need no release, as in AscendC);
//   * within one launch, no two cores store into the same 32-byte GM block (stores are block-granular on
//     some SoCs, so cores sharing a block can overwrite each other's tail).
// Any violation throws std::logic_error with a message, which the test harness returns to Python.
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

// Entry points of a test library. The tests build with -fvisibility=hidden and load several libraries (the real
// kernel, mutated copies, probes) into one process: hidden, each keeps its own emulation state, where default
// visibility would make the function-local statics below STB_GNU_UNIQUE, i.e. one copy shared by all of them.
#define ASCENDC_EMULATION_EXPORT extern "C" __attribute__((visibility("default")))

namespace AscendC {

enum class QuePosition { VECIN, VECOUT, VECCALC };

namespace emulation {
constexpr int64_t kUbBytes = 192 * 1024;
constexpr int64_t kBlock = 32;
constexpr int64_t kMaxBlockCount = 4095;  // documented range of DataCopyExtParams::blockCount

struct Core {
  int64_t block_idx = 0;
  int64_t block_num = 1;
  std::vector<uint8_t> ub = std::vector<uint8_t>(kUbBytes);
  int64_t ub_used = 0;
  int64_t buffers = 0;                  // InitBuffer calls so far: names queues in messages
  std::vector<std::string> unbalanced;  // queues destroyed with tensors still out; end_core reports them
};

inline Core& core() {
  static thread_local Core c;
  return c;
}

[[noreturn]] inline void fail(const std::string& what) { throw std::logic_error("AscendC emulation: " + what); }

// Literal messages only: a message that needs building is built on failure, `if (!ok) fail(...)`, since these
// checks run for every element a kernel touches.
inline void require(bool ok, const char* what) {
  if (!ok) fail(what);
}

inline std::string byte_range(int64_t begin, int64_t end) {
  return "bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

// A GM buffer of the current launch, registered by the launcher before the first core runs.
struct GmRegion {
  std::string name;
  uintptr_t begin;
  int64_t bytes;
  bool writable;
};

inline std::vector<GmRegion>& gm_regions() {
  static thread_local std::vector<GmRegion> regions;
  return regions;
}

// 32-byte GM block -> core that stored into it during the current launch.
inline std::map<uintptr_t, int64_t>& gm_block_owner() {
  static thread_local std::map<uintptr_t, int64_t> owners;
  return owners;
}

// Called by the launcher before registering the launch's GM buffers and running its first core.
inline void begin_launch() {
  gm_block_owner().clear();
  gm_regions().clear();
}

// Called by the launcher once the launch is over (or failed): its GM buffers are gone.
inline void end_launch() {
  gm_block_owner().clear();
  gm_regions().clear();
}

inline void register_gm(const std::string& name, const void* begin, int64_t bytes, bool writable) {
  if (begin == nullptr || bytes < 0) fail("register_gm: '" + name + "' needs an address and a size");
  gm_regions().push_back(GmRegion{name, reinterpret_cast<uintptr_t>(begin), bytes, writable});
}

// Index of the registered buffer holding [p, p + bytes); an empty view may start one past its end.
inline int find_gm_region(const void* p, int64_t bytes, const char* op) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const std::vector<GmRegion>& regions = gm_regions();
  for (size_t i = 0; i < regions.size(); ++i) {
    const uintptr_t end = regions[i].begin + regions[i].bytes;
    if (a < regions[i].begin || a > end || (a == end && bytes > 0)) continue;
    const int64_t off = static_cast<int64_t>(a - regions[i].begin);
    if (off + bytes > regions[i].bytes) {
      fail(std::string(op) + ": " + byte_range(off, off + bytes) + " exceed registered GM '" + regions[i].name +
           "' (" + std::to_string(regions[i].bytes) + " bytes)");
    }
    return static_cast<int>(i);
  }
  fail(std::string(op) + ": address is not inside any registered GM buffer");
}

// Bytes [p, p + bytes) of an access through a GlobalTensor pointing into registered buffer `region`.
inline void check_gm_access(const char* op, int region, const void* p, int64_t bytes, bool write) {
  const char* dir = write ? "write" : "read";
  if (region < 0) fail(std::string(op) + ": GM " + dir + " through a GlobalTensor with no buffer (null address)");
  const GmRegion& r = gm_regions().at(static_cast<size_t>(region));
  const int64_t off = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) - r.begin);
  if (off < 0 || off + bytes > r.bytes) {
    fail(std::string(op) + ": GM " + dir + " out of bounds: " + byte_range(off, off + bytes) + " of '" + r.name +
         "' (" + std::to_string(r.bytes) + " bytes registered)");
  }
  if (write && !r.writable) fail(std::string(op) + ": GM write into read-only input '" + r.name + "'");
}

inline void claim_gm_blocks(const uint8_t* begin, int64_t bytes) {
  if (bytes <= 0) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) / kBlock;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(begin) + bytes - 1) / kBlock;
  for (uintptr_t block = first; block <= last; ++block) {
    auto [it, inserted] = gm_block_owner().emplace(block, core().block_idx);
    if (!inserted && it->second != core().block_idx) {
      fail("two cores store into one 32-byte GM block (cores " + std::to_string(it->second) + " and " +
           std::to_string(core().block_idx) + ")");
    }
  }
}

inline int64_t ub_offset(const void* p) {
  return static_cast<const uint8_t*>(p) - core().ub.data();
}

// Called by the launcher before running one core's kernel body.
inline void begin_core(int64_t idx, int64_t num) {
  core().block_idx = idx;
  core().block_num = num;
  core().ub_used = 0;
  core().buffers = 0;
  core().unbalanced.clear();
  std::memset(core().ub.data(), 0xA5, core().ub.size());  // garbage, like real UB
}

// Called by the launcher after one core's kernel body returned (its TQues are destroyed by then).
inline void end_core() {
  std::string all;
  for (const std::string& u : core().unbalanced) all += (all.empty() ? "" : "; ") + u;
  if (!all.empty()) fail("unbalanced queues at kernel end: " + all);
}

inline const char* position_name(QuePosition pos) {
  switch (pos) {
    case QuePosition::VECIN: return "VECIN";
    case QuePosition::VECOUT: return "VECOUT";
    case QuePosition::VECCALC: return "VECCALC";
  }
  return "?";
}

// Life of one TQue buffer. A LocalTensor remembers its buffer and generation, so any use of a stale handle
// (after FreeTensor, even once the buffer was handed out again) is caught.
enum class SlotState { kFree, kAllocated, kQueued, kDequeued };
struct Slot {
  SlotState state = SlotState::kFree;
  uint32_t generation = 0;
};
}  // namespace emulation

inline int64_t GetBlockIdx() { return emulation::core().block_idx; }
inline int64_t GetBlockNum() { return emulation::core().block_num; }

template <typename T>
class LocalTensor {
 public:
  LocalTensor() = default;
  LocalTensor(T* data, int64_t size, const emulation::Slot* slot = nullptr)
      : data_(data), size_(size), slot_(slot), generation_(slot ? slot->generation : 0) {}
  T GetValue(int64_t i) const {
    check_live("LocalTensor::GetValue");
    emulation::require(i >= 0 && i < size_, "LocalTensor::GetValue out of bounds");
    return data_[i];
  }
  void SetValue(int64_t i, T v) {
    check_live("LocalTensor::SetValue");
    emulation::require(i >= 0 && i < size_, "LocalTensor::SetValue out of bounds");
    data_[i] = v;
  }
  LocalTensor operator[](int64_t offset) const {
    emulation::require(offset >= 0 && offset <= size_, "LocalTensor offset out of bounds");
    LocalTensor t(data_ + offset, size_ - offset);
    t.slot_ = slot_;
    t.generation_ = generation_;
    return t;
  }
  T* data() const { return data_; }
  int64_t size() const { return size_; }
  const emulation::Slot* slot() const { return slot_; }
  uint32_t generation() const { return generation_; }

  // A TQue tensor may be touched only between AllocTensor and EnQue, or between DeQue and FreeTensor.
  void check_live(const char* op) const {
    if (slot_ == nullptr) return;  // TBuf tensor: always usable
    if (slot_->generation != generation_ || slot_->state == emulation::SlotState::kFree) {
      emulation::fail(std::string(op) + ": LocalTensor used after FreeTensor");
    }
    if (slot_->state == emulation::SlotState::kQueued) {
      emulation::fail(std::string(op) + ": LocalTensor used while EnQue'd (before DeQue)");
    }
  }

 private:
  T* data_ = nullptr;
  int64_t size_ = 0;
  const emulation::Slot* slot_ = nullptr;
  uint32_t generation_ = 0;
};

template <typename T>
class GlobalTensor {
 public:
  void SetGlobalBuffer(__gm__ T* data, int64_t size = -1) {
    data_ = data;
    size_ = size;
    region_ = -1;
    if (data == nullptr) {
      emulation::require(size <= 0, "SetGlobalBuffer: null address with a non-zero size");
      return;
    }
    region_ = emulation::find_gm_region(data, size < 0 ? 0 : size * static_cast<int64_t>(sizeof(T)),
                                        "SetGlobalBuffer");
  }
  GlobalTensor operator[](int64_t offset) const {
    emulation::require(size_ < 0 || (offset >= 0 && offset <= size_), "GlobalTensor offset out of bounds");
    GlobalTensor g;
    g.region_ = region_;
    g.size_ = size_ < 0 ? -1 : size_ - offset;
    if (data_ == nullptr) {
      emulation::require(offset == 0, "GlobalTensor offset on a null address");
      return g;
    }
    // The view must still start inside the registered buffer (one past its end at most).
    const emulation::GmRegion& r = emulation::gm_regions().at(static_cast<size_t>(region_));
    const int64_t at = static_cast<int64_t>(reinterpret_cast<uintptr_t>(data_) - r.begin) +
                       offset * static_cast<int64_t>(sizeof(T));
    if (at < 0 || at > r.bytes) {
      emulation::fail("GlobalTensor offset out of bounds: byte " + std::to_string(at) + " of '" + r.name + "' (" +
                      std::to_string(r.bytes) + " bytes registered)");
    }
    g.data_ = data_ + offset;
    return g;
  }
  T GetValue(int64_t i) const {
    check_access("GlobalTensor::GetValue", i * static_cast<int64_t>(sizeof(T)), sizeof(T), false);
    return data_[i];
  }
  void SetValue(int64_t i, T v) const {
    check_access("GlobalTensor::SetValue", i * static_cast<int64_t>(sizeof(T)), sizeof(T), true);
    emulation::claim_gm_blocks(reinterpret_cast<const uint8_t*>(data_ + i), sizeof(T));
    data_[i] = v;
  }
  T* data() const { return data_; }
  int64_t size() const { return size_; }

  // Bytes [offset, offset + bytes) of this view: inside its registered buffer and its SetGlobalBuffer size.
  void check_access(const char* op, int64_t offset, int64_t bytes, bool write) const {
    emulation::check_gm_access(op, region_, reinterpret_cast<const uint8_t*>(data_) + offset, bytes, write);
    const int64_t limit = size_ * static_cast<int64_t>(sizeof(T));
    if (size_ >= 0 && (offset < 0 || offset + bytes > limit)) {
      emulation::fail(std::string(op) + ": GM " + (write ? "write" : "read") + " out of bounds: " +
                      emulation::byte_range(offset, offset + bytes) + " of a GlobalTensor of " + std::to_string(limit) +
                      " bytes (its SetGlobalBuffer size)");
    }
  }

 private:
  T* data_ = nullptr;
  int64_t size_ = -1;
  int region_ = -1;
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

namespace emulation {
inline int64_t round_block(int64_t bytes) { return (bytes + kBlock - 1) / kBlock * kBlock; }

inline void check_ub_side(const char* op, const void* ub, const char* side) {
  if (ub_offset(ub) % kBlock != 0) {
    fail(std::string(op) + ": UB " + side + " not 32B aligned (UB byte " + std::to_string(ub_offset(ub)) + ")");
  }
}

inline void check_block_count(const char* op, const DataCopyExtParams& p) {
  if (p.blockCount > kMaxBlockCount) {
    fail(std::string(op) + ": blockCount " + std::to_string(p.blockCount) + " > 4095");
  }
}

// DataCopy without padding moves whole 32-byte blocks: the length must be a multiple of 32 bytes.
inline void check_whole_blocks(const char* op, int64_t bytes) {
  if (bytes % kBlock != 0) {
    fail(std::string(op) + ": " + std::to_string(bytes) +
         " bytes is not a multiple of 32 (use DataCopyPad for unaligned lengths)");
  }
}
}  // namespace emulation

// GM -> UB.
template <typename T>
void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                 const DataCopyPadExtParams<T>& pad) {
  const char* op = "DataCopyPad";
  emulation::require(!pad.isPad, "padding values are not emulated");
  dst.check_live(op);
  emulation::check_ub_side(op, dst.data(), "dst");
  emulation::check_block_count(op, p);
  const int64_t ub_block = emulation::round_block(p.blockLen);
  const uint8_t* gm = reinterpret_cast<const uint8_t*>(src.data());
  uint8_t* ub = reinterpret_cast<uint8_t*>(dst.data());
  for (int64_t b = 0; b < p.blockCount; ++b) {
    const int64_t gm_off = b * (static_cast<int64_t>(p.blockLen) + p.srcStride);
    const int64_t ub_off = b * (ub_block + static_cast<int64_t>(p.dstStride) * emulation::kBlock);
    src.check_access(op, gm_off, p.blockLen, false);
    emulation::require(ub_off + static_cast<int64_t>(p.blockLen) <= dst.size() * static_cast<int64_t>(sizeof(T)),
                       "DataCopyPad: UB write out of bounds");
    std::memcpy(ub + ub_off, gm + gm_off, p.blockLen);
  }
}

// UB -> GM.
template <typename T>
void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
  const char* op = "DataCopyPad";
  src.check_live(op);
  emulation::check_ub_side(op, src.data(), "src");
  emulation::check_block_count(op, p);
  const int64_t ub_block = emulation::round_block(p.blockLen);
  const uint8_t* ub = reinterpret_cast<const uint8_t*>(src.data());
  uint8_t* gm = reinterpret_cast<uint8_t*>(dst.data());
  for (int64_t b = 0; b < p.blockCount; ++b) {
    const int64_t ub_off = b * (ub_block + static_cast<int64_t>(p.srcStride) * emulation::kBlock);
    const int64_t gm_off = b * (static_cast<int64_t>(p.blockLen) + p.dstStride);
    emulation::require(ub_off + static_cast<int64_t>(p.blockLen) <= src.size() * static_cast<int64_t>(sizeof(T)),
                       "DataCopyPad: UB read out of bounds");
    dst.check_access(op, gm_off, p.blockLen, true);
    emulation::claim_gm_blocks(gm + gm_off, p.blockLen);
    std::memcpy(gm + gm_off, ub + ub_off, p.blockLen);
  }
}

// GM -> UB, `count` elements, whole 32-byte blocks only.
template <typename T>
void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, uint32_t count) {
  const char* op = "DataCopy";
  const int64_t bytes = static_cast<int64_t>(count) * static_cast<int64_t>(sizeof(T));
  dst.check_live(op);
  emulation::check_ub_side(op, dst.data(), "dst");
  emulation::check_whole_blocks(op, bytes);
  src.check_access(op, 0, bytes, false);
  emulation::require(count <= dst.size(), "DataCopy: UB write out of bounds");
  std::memcpy(dst.data(), src.data(), static_cast<size_t>(bytes));
}

// UB -> GM, `count` elements, whole 32-byte blocks only.
template <typename T>
void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) {
  const char* op = "DataCopy";
  const int64_t bytes = static_cast<int64_t>(count) * static_cast<int64_t>(sizeof(T));
  src.check_live(op);
  emulation::check_ub_side(op, src.data(), "src");
  emulation::check_whole_blocks(op, bytes);
  emulation::require(count <= src.size(), "DataCopy: UB read out of bounds");
  dst.check_access(op, 0, bytes, true);
  emulation::claim_gm_blocks(reinterpret_cast<const uint8_t*>(dst.data()), bytes);
  std::memcpy(dst.data(), src.data(), static_cast<size_t>(bytes));
}

class TPipe;

template <QuePosition Pos, int32_t Depth>
class TQue {
 public:
  TQue() = default;
  TQue(const TQue&) = delete;
  TQue& operator=(const TQue&) = delete;
  // A destructor must not throw: an unbalanced queue is recorded, and end_core fails the run.
  ~TQue() {
    int64_t held = 0;
    int64_t queued = 0;
    for (const emulation::Slot& s : slots_) {
      held += s.state == emulation::SlotState::kAllocated || s.state == emulation::SlotState::kDequeued;
      queued += s.state == emulation::SlotState::kQueued;
    }
    if (held > 0) {
      emulation::core().unbalanced.push_back(name() + ": " + std::to_string(held) +
                                             " tensor(s) from AllocTensor never passed to FreeTensor (leaked)");
    }
    if (queued > 0) {
      emulation::core().unbalanced.push_back(name() + ": " + std::to_string(queued) +
                                             " tensor(s) EnQue'd and never DeQue'd");
    }
  }

  template <typename T>
  LocalTensor<T> AllocTensor() {
    emulation::require(base_ != nullptr, "TQue::AllocTensor before TPipe::InitBuffer");
    if (free_.empty()) {
      emulation::fail(name() + ": AllocTensor with all " + std::to_string(slots_.size()) +
                      " buffers in use (missing FreeTensor?)");
    }
    const int64_t slot = free_.front();
    free_.pop_front();
    emulation::Slot& s = slots_[static_cast<size_t>(slot)];
    s.state = emulation::SlotState::kAllocated;
    ++s.generation;
    return tensor<T>(slot);
  }
  template <typename T>
  void EnQue(const LocalTensor<T>& t) {
    const int64_t slot = slot_of(t, "EnQue");
    if (slots_[static_cast<size_t>(slot)].state != emulation::SlotState::kAllocated) {
      emulation::fail(name() + ": EnQue of a tensor that is not freshly allocated (already EnQue'd?)");
    }
    if (static_cast<int64_t>(queued_.size()) >= Depth) {
      emulation::fail(name() + ": EnQue beyond the queue depth " + std::to_string(Depth));
    }
    slots_[static_cast<size_t>(slot)].state = emulation::SlotState::kQueued;
    queued_.push_back(slot);
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    emulation::require(!queued_.empty(), "TQue::DeQue on an empty queue");
    const int64_t slot = queued_.front();
    queued_.pop_front();
    slots_[static_cast<size_t>(slot)].state = emulation::SlotState::kDequeued;
    return tensor<T>(slot);
  }
  template <typename T>
  void FreeTensor(const LocalTensor<T>& t) {
    const int64_t slot = slot_of(t, "FreeTensor");
    emulation::Slot& s = slots_[static_cast<size_t>(slot)];
    if (s.state == emulation::SlotState::kFree || t.generation() != s.generation) {
      emulation::fail(name() + ": FreeTensor of a tensor that is not allocated (double free?)");
    }
    if (s.state == emulation::SlotState::kQueued) {
      emulation::fail(name() + ": FreeTensor of a tensor still EnQue'd (DeQue it first)");
    }
    s.state = emulation::SlotState::kFree;
    free_.push_back(slot);
  }

 private:
  friend class TPipe;
  std::string name() const {
    return "TQue #" + std::to_string(id_) + " (" + emulation::position_name(Pos) + ", " +
           std::to_string(slots_.size()) + " x " + std::to_string(bytes_) + " B)";
  }
  template <typename T>
  LocalTensor<T> tensor(int64_t slot) const {
    return LocalTensor<T>(reinterpret_cast<T*>(base_ + slot * bytes_), bytes_ / static_cast<int64_t>(sizeof(T)),
                          &slots_[static_cast<size_t>(slot)]);
  }
  template <typename T>
  int64_t slot_of(const LocalTensor<T>& t, const char* op) const {
    const int64_t off = reinterpret_cast<const uint8_t*>(t.data()) - base_;
    if (base_ == nullptr || off < 0 || off % bytes_ != 0 || off / bytes_ >= static_cast<int64_t>(slots_.size())) {
      emulation::fail(std::string("TQue::") + op + ": tensor does not belong to this TQue");
    }
    return off / bytes_;
  }
  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
  int64_t id_ = -1;
  std::vector<emulation::Slot> slots_;  // sized once by InitBuffer: LocalTensors point into it
  std::deque<int64_t> free_;
  std::deque<int64_t> queued_;
};

template <QuePosition Pos>
class TBuf {
 public:
  template <typename T>
  LocalTensor<T> Get() {
    emulation::require(base_ != nullptr, "TBuf::Get before TPipe::InitBuffer");
    return LocalTensor<T>(reinterpret_cast<T*>(base_), bytes_ / static_cast<int64_t>(sizeof(T)));
  }
  template <typename T>
  LocalTensor<T> Get(uint32_t len) {
    emulation::require(base_ != nullptr, "TBuf::Get before TPipe::InitBuffer");
    emulation::require(static_cast<int64_t>(len) * static_cast<int64_t>(sizeof(T)) <= bytes_,
                       "TBuf::Get longer than its InitBuffer length");
    return LocalTensor<T>(reinterpret_cast<T*>(base_), len);
  }

 private:
  friend class TPipe;
  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
};

class TPipe {
 public:
  // `num` buffers of `bytes` each; the queue's Depth bounds how many are enqueued at once, not `num`.
  template <QuePosition Pos, int32_t Depth>
  void InitBuffer(TQue<Pos, Depth>& que, int32_t num, int64_t bytes) {
    emulation::require(que.base_ == nullptr, "InitBuffer called twice on one TQue");
    emulation::require(num >= 1 && bytes >= 1, "InitBuffer: needs at least one non-empty buffer");
    que.base_ = take(num * round(bytes));
    que.bytes_ = round(bytes);
    que.id_ = emulation::core().buffers++;
    que.slots_.assign(static_cast<size_t>(num), emulation::Slot{});
    for (int32_t i = 0; i < num; ++i) que.free_.push_back(i);
  }
  template <QuePosition Pos>
  void InitBuffer(TBuf<Pos>& buf, int64_t bytes) {
    emulation::require(buf.base_ == nullptr, "InitBuffer called twice on one TBuf");
    buf.base_ = take(round(bytes));
    buf.bytes_ = round(bytes);
    ++emulation::core().buffers;
  }

 private:
  static int64_t round(int64_t bytes) { return emulation::round_block(bytes); }
  static uint8_t* take(int64_t bytes) {
    emulation::Core& c = emulation::core();
    emulation::require(c.ub_used + bytes <= emulation::kUbBytes, "Unified Buffer overflow (192 KiB per core)");
    uint8_t* p = c.ub.data() + c.ub_used;
    c.ub_used += bytes;
    return p;
  }
};

}  // namespace AscendC
