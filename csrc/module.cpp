// SPDX-License-Identifier: Apache-2.0
// The importable extension module `vllm_ascend_routing._C`. Importing it runs the static registrations of
// the kernels compiled into it (TORCH_LIBRARY_IMPL for CPU, and CUDA or PrivateUse1); the op's schema is
// defined once, in Python (vllm_ascend_routing/ops/_library.py), which is imported first. BACKEND names the
// device the build is for; record_rows is the CPU kernel's direct entry for the eager capture; CPU_PARALLEL says
// whether that kernel splits a large batch over torch's threads (compiled with OpenMP: csrc/CMakeLists.txt).
#include <Python.h>

#include "cpu/record_rows_python.h"

#ifdef _OPENMP
constexpr long kCpuParallel = 1;
#else
constexpr long kCpuParallel = 0;
#endif

#ifndef VLLM_ASCEND_ROUTING_BACKEND
#error "VLLM_ASCEND_ROUTING_BACKEND must name the backend compiled into _C"
#endif

PyMODINIT_FUNC PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"record_rows", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(vllm_ascend_routing::cpu::RecordRowsPython)),
       METH_FASTCALL, vllm_ascend_routing::cpu::kRecordRowsDoc},
      {nullptr, nullptr, 0, nullptr}};
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "record_topk_ids native kernels", -1, methods};
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && (PyModule_AddStringConstant(m, "BACKEND", VLLM_ASCEND_ROUTING_BACKEND) != 0 ||
                       PyModule_AddIntConstant(m, "CPU_PARALLEL", kCpuParallel) != 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
