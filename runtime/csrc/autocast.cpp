// Mixed-precision autocast with a chosen dtype: tch only toggles CUDA autocast (at its default,
// f16); bf16 and CPU autocast need these calls.
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

#include "error.h"

namespace {

// Whether oneDNN runs an LSTM in `dtype` on this CPU. For bf16, what libtorch's own
// `mkldnn::_is_mkldnn_bf16_supported` answers (false where libtorch has no oneDNN: then nothing
// takes the oneDNN path anyway). Never for f16: on a CPU with AVX-512 FP16, whose f16 oneDNN
// says it supports, its LSTM still fails in libtorch 2.11 (torch.autocast("cpu", float16) on an
// nn.LSTM fails the same way in PyTorch on such a CPU).
bool onednn_runs(at::ScalarType dtype) {
  if (dtype != at::kBFloat16) return false;
  auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_is_mkldnn_bf16_supported", ""});
  return handle.has_value() && handle->typed<bool()>().call();
}

}  // namespace

extern "C" {

// Before CPU autocast at `dtype` (a c10::ScalarType) is entered: turns oneDNN off where this
// CPU's oneDNN has no kernels for the dtype, and says in `before` what to restore when that
// autocast level is left (1 or 0), or -1 when it changed nothing (oneDNN runs the dtype, or an
// outer level turned it off already). CPU autocast casts the input of `mkldnn_rnn_layer` (an
// LSTM's oneDNN kernel) to its dtype even where oneDNN cannot run it: bf16 on CPUs without
// AVX-512 BF16, f16 on any ("could not create a primitive descriptor for the LSTM forward
// propagation primitive"). With oneDNN off the LSTM runs libtorch's own cells, whose matmuls autocast still runs
// in the chosen dtype, so the loop stays mixed precision. The setting is libtorch's, process-wide.
int tchmem_onednn_off_for(int dtype, int* before, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        *before = -1;
        if (!at::globalContext().userEnabledMkldnn()) return;
        if (onednn_runs(static_cast<at::ScalarType>(dtype))) return;
        *before = 1;
        at::globalContext().setUserEnabledMkldnn(false);
      },
      err, err_len);
}

// Sets libtorch's oneDNN switch (what `tchmem_onednn_off_for` said to restore).
int tchmem_onednn_set(int enabled, char* err, size_t err_len) {
  return tchmem::guarded([&] { at::globalContext().setUserEnabledMkldnn(enabled != 0); }, err,
                         err_len);
}

// Autocast of one device type (0 = CPU, 1 = CUDA): reads the current setting.
int tchmem_autocast_get(int cuda, int* enabled, int* dtype, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto type = cuda ? at::kCUDA : at::kCPU;
        *enabled = at::autocast::is_autocast_enabled(type);
        *dtype = static_cast<int>(at::autocast::get_autocast_dtype(type));
      },
      err, err_len);
}

// Sets autocast of one device type and its dtype (a c10::ScalarType, as tch's Kind numbers it).
// Entering bumps the nesting counter; leaving the outermost level clears the cast cache, as
// torch.autocast does.
int tchmem_autocast_set(int cuda, int enabled, int dtype, int entering, char* err,
                        size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto type = cuda ? at::kCUDA : at::kCPU;
        at::autocast::set_autocast_dtype(type, static_cast<at::ScalarType>(dtype));
        at::autocast::set_autocast_enabled(type, enabled != 0);
        if (entering) {
          at::autocast::increment_nesting();
        } else if (at::autocast::decrement_nesting() == 0) {
          at::autocast::clear_cache();
        }
      },
      err, err_len);
}

}  // extern "C"


extern "C" {

// Unscales `n` gradients in place with one multi-tensor kernel per device and dtype group
// (torch's `_amp_foreach_non_finite_check_and_unscale_`, which tch does not expose) and sets
// `found_inf` to 1 if any holds inf/nan.
int tchmem_amp_unscale(at::Tensor* const* grads, size_t n, at::Tensor* found_inf,
                       const at::Tensor* inv_scale, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        std::vector<at::Tensor> list;
        list.reserve(n);
        for (size_t i = 0; i < n; ++i) list.push_back(*grads[i]);
        at::_amp_foreach_non_finite_check_and_unscale_(list, *found_inf, *inv_scale);
      },
      err, err_len);
}

}  // extern "C"
