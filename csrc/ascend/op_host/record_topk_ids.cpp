// SPDX-License-Identifier: Apache-2.0
// Torch binding of record_topk_ids for Ascend NPUs (dispatch key PrivateUse1 = torch_npu).
//
// Host work per call, all on the device stream (no host synchronisation, graph-capturable):
//   ids narrowed to int32 by clamping (never wrapping: an id >= 2^31 must stay out of range);
//   one launch of the AscendC kernel over min(N, AI-vector cores) cores, tiled by record_topk_ids_tiling.h;
//   errors += sum of the per-core counts the kernel wrote to a small workspace.
// The launch goes through torch_npu's OpCommand queue so it stays ordered with other NPU work
// (the sgl-kernel-npu pattern). Built only with VLLM_ASCEND_ROUTING_TARGET_DEVICE=npu and CANN.
#include <torch/library.h>

#include <limits>
#include <optional>

#include "aclrtlaunch_record_topk_ids_int16.h"
#include "record_topk_ids_checks.h"
#include "record_topk_ids_tiling.h"
#include "tiling/platform/platform_ascendc.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

namespace vllm_ascend_routing {
namespace {

at::Tensor ClampToInt32(const at::Tensor& t) {
  if (t.scalar_type() == at::kInt) return t.contiguous();
  return t.clamp(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()).to(at::kInt).contiguous();
}

int64_t AivCores() {
  return static_cast<int64_t>(platform_ascendc::PlatformAscendCManager::GetInstance()->GetCoreNumAiv());
}

}  // namespace

void record_topk_ids_npu(const at::Tensor& topk_ids, at::Tensor& out, int64_t layer_id,
                         std::optional<int64_t> num_experts, at::Tensor& errors) {
  CheckRecordArguments(topk_ids, out, layer_id, errors);
  const int64_t num_tokens = topk_ids.size(0);
  if (num_tokens == 0) return;

  const RecordTiling tiling = MakeRecordTiling(num_tokens, topk_ids.size(1), out.size(1), layer_id,
                                               num_experts.has_value() ? *num_experts : -1);
  const uint32_t block_dim = RecordBlockDim(num_tokens, AivCores(), tiling);
  at::Tensor ids = ClampToInt32(topk_ids);
  at::Tensor workspace = at::zeros({static_cast<int64_t>(block_dim) * kErrorsStride}, out.options().dtype(at::kInt));

  void* ids_ptr = ids.data_ptr();
  void* out_ptr = out.data_ptr();
  void* ws_ptr = workspace.data_ptr();
  at_npu::native::OpCommand::RunOpApi("record_topk_ids", [=]() -> int {
    aclrtStream stream = c10_npu::getCurrentNPUStream().stream(false);
    return ACLRT_LAUNCH_KERNEL(record_topk_ids_int16)(block_dim, stream, ids_ptr, out_ptr, ws_ptr, tiling);
  });
  errors.add_(workspace.sum().to(errors.scalar_type()));
}

TORCH_LIBRARY_IMPL(vllm_ascend_routing, PrivateUse1, m) { m.impl("record_topk_ids", &record_topk_ids_npu); }

}  // namespace vllm_ascend_routing
