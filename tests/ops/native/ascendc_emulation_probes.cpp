// SPDX-License-Identifier: Apache-2.0
// Direct probes of the AscendC emulation's checks, one misuse each (plus a clean control), so a check that
// silently stopped firing is noticed even where no kernel mutation reaches it. run_probe(name) runs one
// probe as a launch of one core and returns 0 when it ran clean, 1 with the emulation's message when a
// check fired, 2 for an unknown name.
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>

#include "kernel_operator.h"

using namespace AscendC;

namespace {

// Two 32-byte GM blocks per buffer: `input` registered read-only, `output` writable.
alignas(512) int16_t input[32];
alignas(512) int16_t output[32];

void register_buffers() {
  emulation::register_gm("input", input, sizeof(input), false);
  emulation::register_gm("output", output, sizeof(output), true);
}

using Probe = std::function<void()>;

const std::map<std::string, Probe>& probes() {
  static const std::map<std::string, Probe> all = {
      {"clean", [] {
         // Every primitive used as the kernel uses it: must not fire.
         TPipe pipe;
         TQue<QuePosition::VECIN, 2> que;
         pipe.InitBuffer(que, 2, 64);
         GlobalTensor<int16_t> in, out;
         in.SetGlobalBuffer(input, 32);
         out.SetGlobalBuffer(output);
         LocalTensor<int16_t> t = que.AllocTensor<int16_t>();
         DataCopyPad(t, in[3], DataCopyExtParams(2, 6, 2, 0, 0), DataCopyPadExtParams<int16_t>(false, 0, 0, 0));
         que.EnQue(t);
         LocalTensor<int16_t> u = que.DeQue<int16_t>();
         DataCopyPad(out[1], u, DataCopyExtParams(2, 6, 0, 4, 0));
         DataCopy(out, u, 16);
         out.SetValue(31, in.GetValue(0));
         que.FreeTensor(u);
       }},
      {"gm_write_past_registered_pad", [] {
         TPipe pipe;
         TBuf<QuePosition::VECCALC> buf;
         pipe.InitBuffer(buf, 128);
         GlobalTensor<int16_t> out;
         out.SetGlobalBuffer(output);  // no size: only the registered 64 bytes bound the copy
         DataCopyPad(out[16], buf.Get<int16_t>(), DataCopyExtParams(1, 34, 0, 0, 0));
       }},
      {"gm_write_past_registered_strided", [] {
         TPipe pipe;
         TBuf<QuePosition::VECCALC> buf;
         pipe.InitBuffer(buf, 128);
         GlobalTensor<int16_t> out;
         out.SetGlobalBuffer(output);
         DataCopyPad(out, buf.Get<int16_t>(), DataCopyExtParams(3, 8, 0, 24, 0));  // third block at byte 64
       }},
      {"gm_write_past_registered_datacopy", [] {
         TPipe pipe;
         TBuf<QuePosition::VECCALC> buf;
         pipe.InitBuffer(buf, 128);
         GlobalTensor<int16_t> out;
         out.SetGlobalBuffer(output);
         DataCopy(out[16], buf.Get<int16_t>(), 32);
       }},
      {"gm_write_past_registered_setvalue", [] {
         GlobalTensor<int16_t> out;
         out.SetGlobalBuffer(output);
         out.SetValue(32, 1);
       }},
      {"gm_write_past_declared_size", [] {
         TPipe pipe;
         TBuf<QuePosition::VECCALC> buf;
         pipe.InitBuffer(buf, 64);
         GlobalTensor<int16_t> out;
         out.SetGlobalBuffer(output, 4);  // inside the registered buffer, but the kernel said 4 elements
         DataCopyPad(out, buf.Get<int16_t>(), DataCopyExtParams(1, 10, 0, 0, 0));
       }},
      {"gm_write_into_input", [] {
         GlobalTensor<int16_t> in;
         in.SetGlobalBuffer(input, 32);
         in.SetValue(0, 1);
       }},
      {"gm_unregistered_address", [] {
         static int16_t elsewhere[16];
         GlobalTensor<int16_t> g;
         g.SetGlobalBuffer(elsewhere, 16);
       }},
      {"gm_null_buffer_write", [] {
         GlobalTensor<int16_t> g;
         g.SetGlobalBuffer(nullptr, 0);
         g.SetValue(0, 1);
       }},
      {"gm_size_exceeds_registered", [] {
         GlobalTensor<int16_t> g;
         g.SetGlobalBuffer(output + 8, 32);
       }},
      {"ub_misaligned_pad", [] {
         TPipe pipe;
         TBuf<QuePosition::VECCALC> buf;
         pipe.InitBuffer(buf, 64);
         GlobalTensor<int16_t> out;
         out.SetGlobalBuffer(output, 32);
         DataCopyPad(out, buf.Get<int16_t>()[3], DataCopyExtParams(1, 4, 0, 0, 0));
       }},
      {"datacopy_partial_block", [] {
         TPipe pipe;
         TBuf<QuePosition::VECCALC> buf;
         pipe.InitBuffer(buf, 64);
         GlobalTensor<int16_t> in;
         in.SetGlobalBuffer(input, 32);
         DataCopy(buf.Get<int16_t>(), in, 10);
       }},
      {"leaked_alloc", [] {
         TPipe pipe;
         TQue<QuePosition::VECOUT, 2> que;
         pipe.InitBuffer(que, 2, 32);
         que.AllocTensor<int16_t>();
       }},
      {"enque_never_dequeued", [] {
         TPipe pipe;
         TQue<QuePosition::VECIN, 2> que;
         pipe.InitBuffer(que, 2, 32);
         que.EnQue(que.AllocTensor<int16_t>());
       }},
      {"double_free", [] {
         TPipe pipe;
         TQue<QuePosition::VECIN, 2> que;
         pipe.InitBuffer(que, 2, 32);
         LocalTensor<int16_t> t = que.AllocTensor<int16_t>();
         que.FreeTensor(t);
         que.FreeTensor(t);
       }},
      {"free_while_enqueued", [] {
         TPipe pipe;
         TQue<QuePosition::VECIN, 2> que;
         pipe.InitBuffer(que, 2, 32);
         LocalTensor<int16_t> t = que.AllocTensor<int16_t>();
         que.EnQue(t);
         que.FreeTensor(t);
       }},
      {"use_after_free", [] {
         TPipe pipe;
         TQue<QuePosition::VECIN, 1> que;
         pipe.InitBuffer(que, 1, 32);
         LocalTensor<int16_t> stale = que.AllocTensor<int16_t>();
         que.FreeTensor(stale);
         LocalTensor<int16_t> fresh = que.AllocTensor<int16_t>();  // same buffer, handed out again
         stale.SetValue(0, 1);
         que.FreeTensor(fresh);
       }},
      {"use_while_enqueued", [] {
         TPipe pipe;
         TQue<QuePosition::VECIN, 2> que;
         pipe.InitBuffer(que, 2, 32);
         LocalTensor<int16_t> t = que.AllocTensor<int16_t>();
         que.EnQue(t);
         t.SetValue(0, 1);
       }},
      {"enque_beyond_depth", [] {
         TPipe pipe;
         TQue<QuePosition::VECIN, 1> que;
         pipe.InitBuffer(que, 2, 32);
         que.EnQue(que.AllocTensor<int16_t>());
         que.EnQue(que.AllocTensor<int16_t>());
       }},
      {"alloc_beyond_buffers", [] {
         TPipe pipe;
         TQue<QuePosition::VECIN, 2> que;
         pipe.InitBuffer(que, 2, 32);
         que.AllocTensor<int16_t>();
         que.AllocTensor<int16_t>();
         que.AllocTensor<int16_t>();
       }},
      {"ub_overflow", [] {
         TPipe pipe;
         TQue<QuePosition::VECIN, 2> que;
         pipe.InitBuffer(que, 2, 100 * 1024);
       }},
  };
  return all;
}

}  // namespace

ASCENDC_EMULATION_EXPORT int run_probe(const char* name, char* message, int64_t message_len) {
  const auto it = probes().find(name);
  if (it == probes().end()) return 2;
  try {
    emulation::begin_launch();
    register_buffers();
    emulation::begin_core(0, 1);
    it->second();  // its TQues are destroyed on return, as a kernel's are
    emulation::end_core();
    emulation::end_launch();
  } catch (const std::exception& e) {
    emulation::end_launch();
    std::strncpy(message, e.what(), static_cast<size_t>(message_len - 1));
    message[message_len - 1] = '\0';
    return 1;
  }
  return 0;
}

ASCENDC_EMULATION_EXPORT int64_t probe_count() { return static_cast<int64_t>(probes().size()); }
