// SPDX-License-Identifier: Apache-2.0
// record_rows: the CPU kernel called straight from Python. The eager capture runs once per MoE layer per step;
// through torch's dispatcher a call costs about 3 us on the CPU, several times the write of a decode step's ids,
// so the eager path comes here instead (ops/_recorder.py). Every argument is checked, none trusted; anything
// unusual is declined (None) rather than handled here, so the op stays the one place that raises.
#include "record_rows_python.h"

#include <torch/csrc/autograd/python_variable.h>

#include "record_topk_ids_cpu.h"

namespace vllm_ascend_routing::cpu {
namespace {

// A plain dense CPU tensor with real storage: no tensor subclass or tracer (their Python dispatch key), no
// meta, sparse or autograd-tracked tensor.
bool plain_cpu(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() && t.has_storage() &&
         !t.key_set().has(c10::DispatchKey::Python) && !t.requires_grad();
}

bool id_or_count_dtype(const at::Tensor& t) { return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong; }

}  // namespace

PyObject* RecordRowsPython(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "record_rows(topk_ids, out, layer_id, limit, errors) takes 5 arguments");
    return nullptr;
  }
  if (!THPVariable_Check(args[0]) || !THPVariable_Check(args[1]) || !THPVariable_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "record_rows: topk_ids, out and errors must be tensors");
    return nullptr;
  }
  const long long layer_id = PyLong_AsLongLong(args[2]);
  if (layer_id == -1 && PyErr_Occurred()) return nullptr;
  const long long limit = PyLong_AsLongLong(args[3]);
  if (limit == -1 && PyErr_Occurred()) return nullptr;
  const at::Tensor& ids = THPVariable_Unpack(args[0]);
  const at::Tensor& out = THPVariable_Unpack(args[1]);
  const at::Tensor& errors = THPVariable_Unpack(args[4]);
  const bool applies = plain_cpu(ids) && plain_cpu(out) && plain_cpu(errors) && id_or_count_dtype(ids) &&
                       ids.dim() == 2 && out.dim() == 3 && out.scalar_type() == at::kShort &&
                       out.size(2) == ids.size(1) && ids.size(0) <= out.size(0) && 0 <= layer_id &&
                       layer_id < out.size(1) && errors.numel() == 1 && id_or_count_dtype(errors);
  if (!applies) Py_RETURN_NONE;
  RecordTopkIdsCpu(ids, out, layer_id, limit, errors);
  Py_RETURN_TRUE;
}

}  // namespace vllm_ascend_routing::cpu
