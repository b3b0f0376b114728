// Compiles every dtype combination the torch binding dispatches to (built by tests/ops/test_cuda_kernel.py
// with a bare nvcc: no GPU and no CUDA build of torch needed).
#include "record_topk_ids_kernel.cuh"

namespace vr = vllm_ascend_routing;

template <typename IdT, typename RowT, typename OutT, typename ErrT>
cudaError_t instantiate() {
  vr::RecordParams p{0, 1, 1, 0, -1, -1};
  return vr::launch_record_topk_ids<IdT, RowT, OutT, ErrT>(nullptr, nullptr, nullptr, nullptr, p, nullptr);
}

template <typename IdT, typename RowT, typename OutT>
void with_errors() {
  instantiate<IdT, RowT, OutT, int32_t>();
  instantiate<IdT, RowT, OutT, int64_t>();
}

template <typename IdT, typename RowT>
void with_out() {
  with_errors<IdT, RowT, int16_t>();
  with_errors<IdT, RowT, uint8_t>();
}

int main() {
  with_out<int32_t, int32_t>();
  with_out<int32_t, int64_t>();
  with_out<int64_t, int32_t>();
  with_out<int64_t, int64_t>();
  return 0;
}
