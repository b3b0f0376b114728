// SPDX-License-Identifier: Apache-2.0
// Torch binding of record_topk_ids for CPU tensors: what torch.compile'd graphs and the public op call on the
// host. The eager capture calls the same kernel through record_rows_python.cpp, without the dispatcher.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <optional>

#include "record_topk_ids_checks.h"
#include "record_topk_ids_cpu.h"
#include "record_topk_ids_rows.h"

namespace vllm_ascend_routing::cpu {
namespace {

// Large batches (a long prefill chunk) are split by rows over torch's intra-op threads, as Tensor.copy_ splits
// a large copy: each row is a store to its own cache line of the [R, L, K] buffer, so one thread is bound by
// memory latency. Below ATen's grain (kGrainIds ids) the rows are written on the calling thread, with no
// parallel region entered. The module is compiled with -fopenmp and links no OpenMP runtime of its own: the
// region runs on the runtime torch itself loaded (libtorch_cpu's), with torch's thread count
// (torch.set_num_threads); without -fopenmp ATen's parallel_reduce would run serially.
constexpr int64_t kGrainIds = 32768;  // at::internal::GRAIN_SIZE: below it ATen's own loops stay on one thread

template <typename IdT>
int64_t RecordRowsSplit(const IdT* ids, int16_t* out, const Rows& rows) {
  const int64_t grain_rows = std::max<int64_t>(1, kGrainIds / std::max<int64_t>(1, rows.top_k));
  if (rows.num_tokens <= grain_rows) return RecordRows(ids, out, rows);
  return at::parallel_reduce(
      0, rows.num_tokens, grain_rows, int64_t{0},
      [&](int64_t begin, int64_t end, int64_t invalid) {
        Rows part = rows;
        part.num_tokens = end - begin;
        return invalid + RecordRows(ids + begin * rows.ids_row_stride, out + begin * rows.out_row_stride, part);
      },
      std::plus<int64_t>());
}

}  // namespace

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
                              ? RecordRowsSplit(topk_ids.data_ptr<int32_t>(), layer, rows)
                              : RecordRowsSplit(topk_ids.data_ptr<int64_t>(), layer, rows);
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
