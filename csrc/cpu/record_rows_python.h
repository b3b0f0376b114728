// SPDX-License-Identifier: Apache-2.0
// The eager capture's direct entry into the CPU kernel, a method of the _C module (module.cpp).
#pragma once

#include <Python.h>

namespace vllm_ascend_routing::cpu {

// record_rows(topk_ids, out, layer_id, limit, errors) -> True | None: record_topk_ids's CPU kernel called from
// Python without torch's dispatcher. True when written (invalid ids stored as -1 and added to errors); None,
// with nothing written, where the arguments are not plain CPU tensors the op accepts (another dtype or rank,
// K differs, N > R, a tensor subclass): the caller then takes the op, which raises the op's own error.
PyObject* RecordRowsPython(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

inline constexpr const char* kRecordRowsDoc =
    "record_rows(topk_ids, out, layer_id, limit, errors): record_topk_ids on CPU tensors without the dispatcher; "
    "True when written, None (nothing written) where the op's CPU kernel is not what these tensors need";

}  // namespace vllm_ascend_routing::cpu
