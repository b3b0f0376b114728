// SPDX-License-Identifier: Apache-2.0
// The CPU kernel of record_topk_ids on tensors: shared by the op's CPU binding and the direct entry.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace vllm_ascend_routing::cpu {

// Writes topk_ids [N, K] into out[:N, layer_id] (out [R, L, K] int16, any strides) under the invalid-id rule
// for ids in [0, limit) (limit < 0: no check), adding the invalid count to errors[0]. Arguments already checked.
void RecordTopkIdsCpu(const at::Tensor& topk_ids, const at::Tensor& out, int64_t layer_id, int64_t limit,
                      const at::Tensor& errors);

}  // namespace vllm_ascend_routing::cpu
