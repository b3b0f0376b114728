// SPDX-License-Identifier: Apache-2.0
// Torch binding of record_topk_ids for CPU tensors: what torch.compile'd graphs and the public op call on the
// host. The eager capture calls the same kernel through record_rows_python.cpp, without the dispatcher.
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "record_topk_ids_checks.h"
#include "record_topk_ids_cpu.h"
#include "record_topk_ids_rows.h"

namespace vllm_ascend_routing::cpu {

void RecordTopkIdsCpu(const at::Tensor& topk_ids, const at::Tensor& out, int64_t layer_id, int64_t limit,
                      const at::Tensor& errors) {
  const Rows rows{topk_ids.size(0),
                  topk_ids.size(1),
                  topk_ids.stride(0),
                  topk_ids.stride(1),
                  out.stride(0),
                  out.stride(2),
                  limit < 0 ? -1 : std::min(limit, kStorageLimit)};
  int16_t* layer = out.data_ptr<int16_t>() + layer_id * out.stride(1);
  const int64_t invalid = topk_ids.scalar_type() == at::kInt
                              ? RecordRows(topk_ids.data_ptr<int32_t>(), layer, rows)
                              : RecordRows(topk_ids.data_ptr<int64_t>(), layer, rows);
  if (invalid == 0) return;
  if (errors.scalar_type() == at::kInt) {
    *errors.data_ptr<int32_t>() += static_cast<int32_t>(invalid);
  } else {
    *errors.data_ptr<int64_t>() += invalid;
  }
}

namespace {

void record_topk_ids_cpu(const at::Tensor& topk_ids, at::Tensor& out, int64_t layer_id,
                         std::optional<int64_t> num_experts, at::Tensor& errors) {
  CheckRecordArguments(topk_ids, out, layer_id, errors, /*out_contiguous=*/false);
  RecordTopkIdsCpu(topk_ids, out, layer_id, num_experts.value_or(-1), errors);
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_ascend_routing, CPU, m) { m.impl("record_topk_ids", &record_topk_ids_cpu); }

}  // namespace vllm_ascend_routing::cpu
