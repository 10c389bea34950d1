// Mixed-precision autocast with a chosen dtype: tch only toggles CUDA autocast (at its default,
// f16); bf16 and CPU autocast need these calls.
#include <ATen/Functions.h>
#include <ATen/autocast_mode.h>

#include <vector>

#include "error.h"

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
