// Adam and AdamW through torch's fused kernels (`_fused_adam_` / `_fused_adamw_`, which tch does
// not expose): one kernel per device and dtype for all parameters, where libtorch's C++
// optimizers (tch's nn::Adam / nn::AdamW) launch several per parameter.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "error.h"

#include <map>
#include <tuple>
#include <vector>

namespace {

// The lists one fused call takes: tensors of one device and dtype.
struct Group {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
};

}  // namespace

extern "C" {

// One Adam step over `n` parameters that all have a gradient: `steps` (f32 scalars on the
// parameter's device) are incremented first, as torch.optim does; `max_exp_avg_sqs` is read
// only with `amsgrad`. `decoupled` selects AdamW's weight decay over Adam's L2 penalty.
int tchmem_fused_adam(at::Tensor* const* params, at::Tensor* const* exp_avgs,
                      at::Tensor* const* exp_avg_sqs, at::Tensor* const* max_exp_avg_sqs,
                      at::Tensor* const* steps, size_t n, double lr, double beta1, double beta2,
                      double weight_decay, double eps, int amsgrad, int decoupled, char* err,
                      size_t err_len) {
  return tchmem::guarded(
      [&] {
        std::map<std::tuple<int, int, int>, Group> groups;
        for (size_t i = 0; i < n; ++i) {
          const at::Tensor& p = *params[i];
          auto key = std::make_tuple(static_cast<int>(p.device().type()),
                                     static_cast<int>(p.device().index()),
                                     static_cast<int>(p.scalar_type()));
          Group& g = groups[key];
          g.params.push_back(p);
          g.grads.push_back(p.grad());
          g.exp_avgs.push_back(*exp_avgs[i]);
          g.exp_avg_sqs.push_back(*exp_avg_sqs[i]);
          if (amsgrad) g.max_exp_avg_sqs.push_back(*max_exp_avg_sqs[i]);
          g.steps.push_back(*steps[i]);
        }
        at::AutoGradMode no_grad(false);
        for (auto& [key, g] : groups) {
          at::_foreach_add_(g.steps, 1);
          if (decoupled) {
            at::_fused_adamw_(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.max_exp_avg_sqs,
                              g.steps, lr, beta1, beta2, weight_decay, eps, amsgrad != 0, false);
          } else {
            at::_fused_adam_(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.max_exp_avg_sqs,
                             g.steps, lr, beta1, beta2, weight_decay, eps, amsgrad != 0, false);
          }
        }
      },
      err, err_len);
}

}  // extern "C"
