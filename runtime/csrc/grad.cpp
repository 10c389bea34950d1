// Setting a tensor's gradient, which tch cannot do (it zeroes a gradient but cannot remove one):
// a trial that kept a model puts its gradients back as they were, none where there were none.
#include <ATen/ATen.h>

#include "error.h"

extern "C" {

// Sets `tensor`'s gradient to `grad`, or removes it when `grad` is null.
int tchmem_set_grad(at::Tensor* tensor, const at::Tensor* grad, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] { tensor->mutable_grad() = grad == nullptr ? at::Tensor() : *grad; }, err, err_len);
}

}  // extern "C"
