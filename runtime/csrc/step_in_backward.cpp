// The optimizer step inside backward: a hook on each parameter that autograd calls as soon as
// the parameter's gradient is complete (after AccumulateGrad, PyTorch's
// register_post_accumulate_grad_hook, which libtorch offers from C++ too), which updates that
// parameter through a Rust callback and then frees its gradient. The whole model's gradients
// then never live at once: only those of the parameters backward is still working on.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "error.h"

#include <memory>
#include <stdexcept>
#include <string>
#include <cstring>
#include <typeinfo>

extern "C" {
// Updates parameter `index` of the optimizer behind `data` from its gradient; returns 0, or -1
// after writing why into `err`.
typedef int (*tchmem_step_one)(void* data, size_t index, char* err, size_t err_len);
}

namespace {

struct StepHook : torch::autograd::PostAccumulateGradHook {
  StepHook(void* data, tchmem_step_one step, size_t index)
      : data(data), step(step), index(index) {}

  void operator()(const torch::autograd::Variable& param) override {
    char err[4096] = {0};
    if (step(data, index, err, sizeof err) != 0) {
      throw std::runtime_error(std::string("the optimizer step in backward failed: ") + err);
    }
    // The step has read the gradient: free it now rather than at the next zero_grad.
    param.mutable_grad().reset();
  }

  void* data;
  tchmem_step_one step;
  size_t index;
};

}  // namespace

extern "C" {

// Makes autograd call `step(data, index)` right after `param`'s gradient is accumulated, then
// free that gradient. Replaces any hook the parameter had; `data` must outlive the hook (remove
// it with tchmem_step_in_backward_remove first).
int tchmem_step_in_backward_add(const at::Tensor* param, void* data, tchmem_step_one step,
                                size_t index, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        if (!param->requires_grad() || !param->is_leaf()) {
          throw std::runtime_error(
              "the optimizer step in backward needs parameters that are leaves requiring grad");
        }
        torch::autograd::impl::set_post_acc_grad_hooks(
            *param, std::make_unique<StepHook>(data, step, index));
      },
      err, err_len);
}

// Removes the hook of `param` if it is the one made for `data` (a newer optimizer over the same
// parameters keeps its own).
int tchmem_step_in_backward_remove(const at::Tensor* param, void* data, char* err,
                                   size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto& hook = torch::autograd::impl::post_acc_grad_hooks(*param);
        if (!hook) return;
        // Every cell links its own copy of this file, so the hook may be another copy's
        // StepHook: the same type by name and layout, not by address (no dynamic_cast).
        if (std::strcmp(typeid(*hook).name(), typeid(StepHook).name()) != 0) return;
        if (static_cast<StepHook*>(hook.get())->data == data) hook.reset();
      },
      err, err_len);
}

}  // extern "C"
