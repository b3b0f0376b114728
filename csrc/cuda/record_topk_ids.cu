// SPDX-License-Identifier: Apache-2.0
// Torch binding of record_topk_ids for CUDA: argument checks, dtype dispatch, launch on the current
// stream (graph-capturable: no host synchronisation, no allocation).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "record_topk_ids_checks.h"
#include "record_topk_ids_kernel.cuh"

namespace vllm_ascend_routing {
namespace {

template <typename IdT, typename RowT, typename OutT, typename ErrT>
void launch(const at::Tensor& topk_ids, at::Tensor& out, const std::optional<at::Tensor>& rows, at::Tensor& errors,
            const RecordParams& params) {
  const RowT* rows_ptr = rows.has_value() ? rows->data_ptr<RowT>() : nullptr;
  const cudaError_t status = launch_record_topk_ids<IdT, RowT, OutT, ErrT>(
      topk_ids.data_ptr<IdT>(), out.data_ptr<OutT>(), rows_ptr, errors.data_ptr<ErrT>(), params,
      at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "record_topk_ids: launch failed: ", cudaGetErrorString(status));
}

template <typename IdT, typename RowT, typename OutT>
void dispatch_errors(const at::Tensor& ids, at::Tensor& out, const std::optional<at::Tensor>& rows, at::Tensor& errors,
                     const RecordParams& params) {
  if (errors.scalar_type() == at::kInt) {
    launch<IdT, RowT, OutT, int32_t>(ids, out, rows, errors, params);
  } else {
    launch<IdT, RowT, OutT, int64_t>(ids, out, rows, errors, params);
  }
}

template <typename IdT, typename RowT>
void dispatch_out(const at::Tensor& ids, at::Tensor& out, const std::optional<at::Tensor>& rows, at::Tensor& errors,
                  const RecordParams& params) {
  if (out.scalar_type() == at::kShort) {
    dispatch_errors<IdT, RowT, int16_t>(ids, out, rows, errors, params);
  } else {
    dispatch_errors<IdT, RowT, uint8_t>(ids, out, rows, errors, params);
  }
}

template <typename IdT>
void dispatch_rows(const at::Tensor& ids, at::Tensor& out, const std::optional<at::Tensor>& rows, at::Tensor& errors,
                   const RecordParams& params) {
  if (rows.has_value() && rows->scalar_type() == at::kLong) {
    dispatch_out<IdT, int64_t>(ids, out, rows, errors, params);
  } else {
    dispatch_out<IdT, int32_t>(ids, out, rows, errors, params);
  }
}

}  // namespace

void record_topk_ids_cuda(const at::Tensor& topk_ids, at::Tensor& out, int64_t layer_id,
                          const std::optional<at::Tensor>& rows, std::optional<int64_t> num_experts,
                          at::Tensor& errors) {
  CheckRecordArguments(topk_ids, out, layer_id, rows, errors);
  const bool narrow = out.scalar_type() == at::kByte;
  const int64_t storage_limit = narrow ? 255 : 32767;  // 255 / -1 mark invalid ids
  RecordParams params{topk_ids.size(0),
                      topk_ids.size(1),
                      out.size(1),
                      layer_id,
                      num_experts.has_value() ? std::min(*num_experts, storage_limit) : -1,
                      narrow ? 255 : -1};
  const at::cuda::OptionalCUDAGuard guard(out.device());
  const at::Tensor ids = topk_ids.contiguous();
  if (ids.scalar_type() == at::kInt) {
    dispatch_rows<int32_t>(ids, out, rows, errors, params);
  } else {
    dispatch_rows<int64_t>(ids, out, rows, errors, params);
  }
}

TORCH_LIBRARY_IMPL(vllm_ascend_routing, CUDA, m) { m.impl("record_topk_ids", &record_topk_ids_cuda); }

}  // namespace vllm_ascend_routing
