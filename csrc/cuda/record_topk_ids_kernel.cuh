// SPDX-License-Identifier: Apache-2.0
// record_topk_ids, CUDA: one thread per (token, slot) element of topk_ids [N, K].
//
// Element e = i * K + k goes to out[i, layer, k] (out int16). With a range check, this kernel implements the
// op's invalid-id rule (defined in vllm_ascend_routing/ops/_id_rule.py): an id outside [0, limit) is stored
// as kInvalidId (-1) and counted; each block reduces its count in shared memory and adds it to `errors` with
// one atomic, so the host never synchronises. No torch headers here: this file compiles with a bare nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace vllm_ascend_routing {

struct RecordParams {
  int64_t num_tokens;   // N
  int64_t top_k;        // K
  int64_t num_layers;   // L (out is [R, L, K], contiguous)
  int64_t layer_id;
  int64_t limit;        // ids must lie in [0, limit); < 0: no range check (values are cast as they are)
};

// The invalid-id rule's constants (vllm_ascend_routing/ops/_id_rule.py: INVALID_ID, STORAGE_LIMIT).
constexpr int16_t kInvalidId = -1;        // stored instead of an out-of-range id
constexpr int64_t kStorageLimit = 32767;  // the most ids int16 records as valid (0 .. 32766)

__device__ inline void add_errors(int32_t* errors, unsigned int count) {
  atomicAdd(reinterpret_cast<int*>(errors), static_cast<int>(count));
}

__device__ inline void add_errors(int64_t* errors, unsigned int count) {
  atomicAdd(reinterpret_cast<unsigned long long*>(errors), static_cast<unsigned long long>(count));
}

template <typename IdT, typename ErrT>
__global__ void record_topk_ids_kernel(const IdT* __restrict__ topk_ids, int16_t* __restrict__ out,
                                       ErrT* __restrict__ errors, RecordParams p) {
  __shared__ unsigned int block_errors;
  if (threadIdx.x == 0) block_errors = 0;
  __syncthreads();

  const int64_t total = p.num_tokens * p.top_k;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = e / p.top_k;
    const int64_t slot = e - token * p.top_k;
    int64_t value = static_cast<int64_t>(topk_ids[e]);
    if (p.limit >= 0 && (value < 0 || value >= p.limit)) {
      value = kInvalidId;
      atomicAdd(&block_errors, 1u);
    }
    out[(token * p.num_layers + p.layer_id) * p.top_k + slot] = static_cast<int16_t>(value);
  }
  __syncthreads();
  if (threadIdx.x == 0 && block_errors != 0 && errors != nullptr) {
    add_errors(errors, block_errors);
  }
}

}  // namespace vllm_ascend_routing

namespace vllm_ascend_routing {

// Enqueue the kernel on `stream`; N == 0 launches nothing.
template <typename IdT, typename ErrT>
inline cudaError_t launch_record_topk_ids(const IdT* topk_ids, int16_t* out, ErrT* errors, const RecordParams& p,
                                          cudaStream_t stream) {
  const int64_t total = p.num_tokens * p.top_k;
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  // Enough blocks to fill the GPU; the grid-stride loop covers any remainder.
  const int64_t wanted = (total + kThreads - 1) / kThreads;
  const unsigned int blocks = static_cast<unsigned int>(wanted < 65535 ? wanted : 65535);
  record_topk_ids_kernel<IdT, ErrT><<<blocks, kThreads, 0, stream>>>(topk_ids, out, errors, p);
  return cudaGetLastError();
}

}  // namespace vllm_ascend_routing
