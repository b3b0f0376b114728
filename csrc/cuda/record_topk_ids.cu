// SPDX-License-Identifier: Apache-2.0
// Torch binding of record_topk_ids for CUDA: argument checks, dtype dispatch, launch on the current
// stream (graph-capturable: no host synchronisation, no allocation).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "record_topk_ids_checks.h"
#include "record_topk_ids_kernel.cuh"

namespace vllm_ascend_routing {
namespace {

template <typename IdT, typename ErrT>
void launch(const at::Tensor& topk_ids, at::Tensor& out, at::Tensor& errors, const RecordParams& params) {
  const cudaError_t status = launch_record_topk_ids<IdT, ErrT>(topk_ids.data_ptr<IdT>(), out.data_ptr<int16_t>(),
                                                               errors.data_ptr<ErrT>(), params,
                                                               at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "record_topk_ids: launch failed: ", cudaGetErrorString(status));
}

template <typename IdT>
void dispatch_errors(const at::Tensor& ids, at::Tensor& out, at::Tensor& errors, const RecordParams& params) {
  if (errors.scalar_type() == at::kInt) {
    launch<IdT, int32_t>(ids, out, errors, params);
  } else {
    launch<IdT, int64_t>(ids, out, errors, params);
  }
}

}  // namespace

void record_topk_ids_cuda(const at::Tensor& topk_ids, at::Tensor& out, int64_t layer_id,
                          std::optional<int64_t> num_experts, at::Tensor& errors) {
  CheckRecordArguments(topk_ids, out, layer_id, errors);
  // The invalid-id rule's limit (ops/_id_rule.py id_limit): at most kStorageLimit ids are valid in int16.
  RecordParams params{topk_ids.size(0), topk_ids.size(1), out.size(1), layer_id,
                      num_experts.has_value() ? std::min(*num_experts, kStorageLimit) : -1};
  const at::cuda::OptionalCUDAGuard guard(out.device());
  const at::Tensor ids = topk_ids.contiguous();
  if (ids.scalar_type() == at::kInt) {
    dispatch_errors<int32_t>(ids, out, errors, params);
  } else {
    dispatch_errors<int64_t>(ids, out, errors, params);
  }
}

TORCH_LIBRARY_IMPL(vllm_ascend_routing, CUDA, m) { m.impl("record_topk_ids", &record_topk_ids_cuda); }

}  // namespace vllm_ascend_routing
