// SPDX-License-Identifier: Apache-2.0
// record_topk_ids, AscendC kernel (AI Core, vector unit).
//
// Tiling: the N tokens are split evenly over blockDim cores; each core walks its share in tiles of
// `tile_tokens` tokens. Per tile:
//   CopyIn   DataCopyPad GM -> UB of the tile's ids (int32, T*K);
//   Compute  range check + narrowing into a UB layout where each token's K values start on a 32-byte
//            boundary (DataCopyPad moves whole 32-byte UB blocks), counting out-of-range ids: the op's
//            invalid-id rule (defined in vllm_ascend_routing/ops/_id_rule.py);
//   CopyOut  one strided DataCopyPad UB -> GM (T blocks of K values, GM stride L*K): token i to row i.
// Each core writes its error count to errors_ws[core * 8] (its own 32-byte block); the host adds the sum
// of the workspace to `errors` on the device.
// Ids arrive as int32 (the host narrows int64 ids on the device first); out is int16.
#include "kernel_operator.h"
#include "record_topk_ids_tiling_data.h"

using namespace AscendC;

namespace vllm_ascend_routing {

constexpr int32_t kBufferNum = 2;  // double buffering of CopyIn against Compute/CopyOut
constexpr int32_t kBlockBytes = 32;

__aicore__ inline int64_t RoundUp(int64_t value, int64_t unit) { return (value + unit - 1) / unit * unit; }

class RecordTopkIds {
 public:
  using OutT = int16_t;  // the capture buffer's storage (ops/_id_rule.py OUT_DTYPE)

  __aicore__ inline RecordTopkIds() {}

  __aicore__ inline void Init(GM_ADDR topk_ids, GM_ADDR out, GM_ADDR errors_ws, const RecordTiling& tiling) {
    tiling_ = tiling;
    const int64_t cores = GetBlockNum();
    const int64_t per_core = (tiling.num_tokens + cores - 1) / cores;
    first_ = per_core * GetBlockIdx();
    count_ = first_ >= tiling.num_tokens ? 0 : (tiling.num_tokens - first_ < per_core ? tiling.num_tokens - first_ : per_core);
    padded_k_ = RoundUp(tiling.top_k * static_cast<int64_t>(sizeof(OutT)), kBlockBytes) / sizeof(OutT);

    ids_gm_.SetGlobalBuffer((__gm__ int32_t*)topk_ids, tiling.num_tokens * tiling.top_k);
    out_gm_.SetGlobalBuffer((__gm__ OutT*)out);
    // One 32-byte block per core, so no two cores store into one GM block.
    errors_gm_.SetGlobalBuffer((__gm__ int32_t*)errors_ws + GetBlockIdx() * kErrorsStride, 1);

    const int64_t t = tiling.tile_tokens;
    pipe_.InitBuffer(ids_queue_, kBufferNum, RoundUp(t * tiling.top_k * sizeof(int32_t), kBlockBytes));
    pipe_.InitBuffer(out_queue_, kBufferNum, t * padded_k_ * sizeof(OutT));
    pipe_.InitBuffer(count_buf_, kBlockBytes);
  }

  __aicore__ inline void Process() {
    int32_t errors = 0;
    for (int64_t done = 0; done < count_; done += tiling_.tile_tokens) {
      const int64_t tokens = count_ - done < tiling_.tile_tokens ? count_ - done : tiling_.tile_tokens;
      CopyIn(first_ + done, tokens);
      errors += Compute(tokens);
      CopyOut(first_ + done, tokens);
    }
    LocalTensor<int32_t> count = count_buf_.Get<int32_t>();
    count.SetValue(0, errors);
    DataCopyPad(errors_gm_, count, DataCopyExtParams(1, sizeof(int32_t), 0, 0, 0));
  }

 private:
  __aicore__ inline void CopyIn(int64_t token, int64_t tokens) {
    LocalTensor<int32_t> ids = ids_queue_.AllocTensor<int32_t>();
    DataCopyPad(ids, ids_gm_[token * tiling_.top_k],
                DataCopyExtParams(1, static_cast<uint32_t>(tokens * tiling_.top_k * sizeof(int32_t)), 0, 0, 0),
                DataCopyPadExtParams<int32_t>(false, 0, 0, 0));
    ids_queue_.EnQue(ids);
  }

  __aicore__ inline int32_t Compute(int64_t tokens) {
    LocalTensor<int32_t> ids = ids_queue_.DeQue<int32_t>();
    LocalTensor<OutT> out = out_queue_.AllocTensor<OutT>();
    int32_t errors = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t k = 0; k < tiling_.top_k; ++k) {
        int32_t value = ids.GetValue(t * tiling_.top_k + k);
        if (tiling_.limit >= 0 && (value < 0 || value >= tiling_.limit)) {
          value = kInvalidId;
          ++errors;
        }
        out.SetValue(t * padded_k_ + k, static_cast<OutT>(value));
      }
    }
    out_queue_.EnQue(out);
    ids_queue_.FreeTensor(ids);
    return errors;
  }

  __aicore__ inline void CopyOut(int64_t token, int64_t tokens) {
    LocalTensor<OutT> out = out_queue_.DeQue<OutT>();
    const uint32_t row_bytes = static_cast<uint32_t>(tiling_.top_k * sizeof(OutT));
    const int64_t layer_offset = tiling_.layer_id * tiling_.top_k;
    const int64_t row_stride = tiling_.num_layers * tiling_.top_k;
    // T blocks of K values; UB blocks are 32-byte padded (srcStride 0), GM rows L*K values apart.
    const uint32_t gap_bytes = static_cast<uint32_t>((row_stride - tiling_.top_k) * sizeof(OutT));
    DataCopyPad(out_gm_[token * row_stride + layer_offset], out,
                DataCopyExtParams(static_cast<uint16_t>(tokens), row_bytes, 0, gap_bytes, 0));
    out_queue_.FreeTensor(out);
  }

  TPipe pipe_;
  TQue<QuePosition::VECIN, kBufferNum> ids_queue_;
  TQue<QuePosition::VECOUT, kBufferNum> out_queue_;
  TBuf<QuePosition::VECCALC> count_buf_;
  GlobalTensor<int32_t> ids_gm_;
  GlobalTensor<OutT> out_gm_;
  GlobalTensor<int32_t> errors_gm_;
  RecordTiling tiling_;
  int64_t first_ = 0;
  int64_t count_ = 0;
  int64_t padded_k_ = 0;
};

}  // namespace vllm_ascend_routing

extern "C" __global__ __aicore__ void record_topk_ids_int16(GM_ADDR topk_ids, GM_ADDR out, GM_ADDR errors_ws,
                                                            vllm_ascend_routing::RecordTiling tiling) {
  vllm_ascend_routing::RecordTopkIds op;
  op.Init(topk_ids, out, errors_ws, tiling);
  op.Process();
}
