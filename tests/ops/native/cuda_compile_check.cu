// Compiles every dtype combination the torch binding dispatches to (built by tests/ops/test_cuda_kernel.py
// with a bare nvcc: no GPU and no CUDA build of torch needed).
#include "record_topk_ids_kernel.cuh"

namespace vr = vllm_ascend_routing;

template <typename IdT, typename ErrT>
cudaError_t instantiate() {
  vr::RecordParams p{0, 1, 1, 0, -1};
  return vr::launch_record_topk_ids<IdT, ErrT>(nullptr, nullptr, nullptr, p, nullptr);
}

int main() {
  instantiate<int32_t, int32_t>();
  instantiate<int32_t, int64_t>();
  instantiate<int64_t, int32_t>();
  instantiate<int64_t, int64_t>();
  return 0;
}
