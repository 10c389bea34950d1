// Mixed-precision autocast with a chosen dtype: tch only toggles CUDA autocast (at its default,
// f16); bf16 and CPU autocast need these calls.
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

#include "error.h"

namespace {

// Whether oneDNN runs `dtype` on this CPU, as libtorch's own `mkldnn::_is_mkldnn_*_supported`
// ops answer (false where libtorch has no oneDNN: then nothing takes the oneDNN path anyway).
bool onednn_runs(at::ScalarType dtype) {
  const char* op = dtype == at::kBFloat16 ? "mkldnn::_is_mkldnn_bf16_supported"
                                          : "mkldnn::_is_mkldnn_fp16_supported";
  auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
  return handle.has_value() && handle->typed<bool()>().call();
}

// oneDNN's setting before CPU autocast turned it off, until the outermost autocast level ends.
// CPU autocast casts the input of `mkldnn_rnn_layer` (an LSTM's oneDNN kernel) to its dtype even
// where oneDNN has no kernel for that dtype on this CPU (no AVX-512 BF16/FP16: "could not create
// a primitive descriptor for the LSTM forward propagation primitive"; PyTorch fixes it after
// 2.11). With oneDNN off the LSTM runs libtorch's own cells, whose matmuls autocast still runs
// in the chosen dtype, so the loop stays mixed precision.
std::optional<bool> onednn_before_autocast;

void keep_autocast_off_onednn_it_lacks(at::ScalarType dtype) {
  if (onednn_before_autocast.has_value() || onednn_runs(dtype)) return;
  onednn_before_autocast = at::globalContext().userEnabledMkldnn();
  at::globalContext().setUserEnabledMkldnn(false);
}

void restore_onednn() {
  if (!onednn_before_autocast.has_value()) return;
  at::globalContext().setUserEnabledMkldnn(*onednn_before_autocast);
  onednn_before_autocast.reset();
}

}  // namespace

extern "C" {

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
// torch.autocast does. Entering CPU autocast at a dtype this CPU's oneDNN lacks turns oneDNN off
// until then (see `onednn_before_autocast`).
int tchmem_autocast_set(int cuda, int enabled, int dtype, int entering, char* err,
                        size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto type = cuda ? at::kCUDA : at::kCPU;
        at::autocast::set_autocast_dtype(type, static_cast<at::ScalarType>(dtype));
        at::autocast::set_autocast_enabled(type, enabled != 0);
        if (entering) {
          if (!cuda && enabled) keep_autocast_off_onednn_it_lacks(static_cast<at::ScalarType>(dtype));
          at::autocast::increment_nesting();
        } else if (at::autocast::decrement_nesting() == 0) {
          at::autocast::clear_cache();
          restore_onednn();
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
