// SPDX-License-Identifier: Apache-2.0
// Argument checks of record_topk_ids shared by the CPU, CUDA and Ascend torch bindings (the Python reference
// has the same rules in vllm_ascend_routing/ops/_library.py::check_arguments). The device kernels index `out`
// as contiguous; the CPU kernel follows its strides (as the Python host kernel did), so it may be any view.
#pragma once

#include <torch/library.h>

namespace vllm_ascend_routing {

inline void CheckRecordArguments(const at::Tensor& topk_ids, const at::Tensor& out, int64_t layer_id,
                                 const at::Tensor& errors, bool out_contiguous = true) {
  TORCH_CHECK(topk_ids.dim() == 2, "record_topk_ids: topk_ids must be [N, K]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
              "record_topk_ids: topk_ids must be int32 or int64");
  TORCH_CHECK(out.dim() == 3, "record_topk_ids: out must be [R, L, K]");
  TORCH_CHECK(!out_contiguous || out.is_contiguous(), "record_topk_ids: out must be contiguous");
  TORCH_CHECK(out.scalar_type() == at::kShort, "record_topk_ids: out must be int16");
  TORCH_CHECK(out.size(2) == topk_ids.size(1), "record_topk_ids: top_k mismatch");
  TORCH_CHECK(0 <= layer_id && layer_id < out.size(1), "record_topk_ids: layer_id out of range");
  TORCH_CHECK(errors.numel() == 1 && (errors.scalar_type() == at::kInt || errors.scalar_type() == at::kLong),
              "record_topk_ids: errors must be a 1-element int32/int64 tensor");
  TORCH_CHECK(topk_ids.device() == out.device() && errors.device() == out.device(),
              "record_topk_ids: tensors must be on one device");
  TORCH_CHECK(topk_ids.size(0) <= out.size(0), "record_topk_ids: tokens do not fit out's rows");
}

}  // namespace vllm_ascend_routing
