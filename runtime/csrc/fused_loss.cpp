// Fused linear cross-entropy: the output projection and the cross-entropy computed chunk by chunk
// over the tokens, with the loss and the gradients of the hidden states, the weight and the bias
// computed in the forward pass. No full logits tensor exists in forward or backward: at any time
// only one chunk's logits (and their softmax, in place) are alive. Backward only scales the
// gradients kept from the forward by the incoming gradient.
//
// The reduction is tch's `cross_entropy_for_logits`: the mean over targets that are not
// `ignore_index`, with the softmax in f32 (f64 for f64 inputs). Under autocast the matmuls run in
// autocast's dtype, as the unfused head would.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include "error.h"

#include <algorithm>
#include <atomic>
#include <string>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per chunk when the caller gives none: a chunk's logits about as large as the hidden
// states themselves (rounded up to a power of two), so the loss never needs much more memory
// than its input.
int64_t default_chunk(int64_t rows, int64_t hidden, int64_t vocab) {
  int64_t per_chunk = std::max<int64_t>(1, (rows * hidden + vocab - 1) / vocab);
  int64_t chunk = 1;
  while (chunk < per_chunk) chunk *= 2;
  return std::min(chunk, std::max<int64_t>(rows, 1));
}

// Whether this libtorch computes a low-precision matmul into an f32 result in place
// (`addmm` with `out_dtype`, CUDA): learnt on the first try.
std::atomic<bool> mixed_addmm_works{true};

// sum += a @ b, with `sum` in f32 or f64 and `a`, `b` in the matmuls' dtype: in place inside
// the matmul where libtorch can (no product of the weight's size per chunk, and the products
// accumulate in f32), else through a temporary product.
void accumulate_product(at::Tensor& sum, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == sum.scalar_type()) {
    sum.addmm_(a, b);
    return;
  }
  const bool low = a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf;
  if (mixed_addmm_works && sum.is_cuda() && sum.scalar_type() == at::kFloat && low) {
    try {
      at::addmm_out(sum, sum, a, b, sum.scalar_type());
      return;
    } catch (const c10::OutOfMemoryError&) {
      throw;  // not this libtorch's limit: the caller's
    } catch (const c10::Error&) {
      mixed_addmm_works = false;  // checked before any work: `sum` is untouched
    }
  }
  sum.add_(at::mm(a, b));
}

// Whether this libtorch's log-softmax writes over its input (`out` = input): learnt on the
// first try.
std::atomic<bool> in_place_log_softmax_works{true};

// x = log_softmax(x) over its rows. Each element's output depends on its own input and the
// row's max and sum, read before any output is written, so the kernels allow it in place; a
// libtorch that refuses gets a copy.
void log_softmax_in_place(at::Tensor& x) {
  if (in_place_log_softmax_works) {
    try {
      at::_log_softmax_out(x, x, 1, false);
      return;
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const c10::Error&) {
      in_place_log_softmax_works = false;
    }
  }
  x = at::_log_softmax(x, 1, false);
}

struct FusedLinearCrossEntropy : torch::autograd::Function<FusedLinearCrossEntropy> {
  // `bias` with no elements stands for none (autograd takes no undefined inputs).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& given_bias,
                            const at::Tensor& targets, int64_t chunk, int64_t ignore_index,
                            bool grad_enabled) {
    const at::Tensor bias = given_bias.numel() > 0 ? given_bias : at::Tensor();
    const int64_t width = hidden.size(-1);
    TORCH_CHECK(weight.dim() == 2 && weight.size(1) == width,
                "fused loss: the weight must be [vocabulary, ", width, "] for hidden states of width ",
                width, ", not ", weight.sizes());
    const int64_t vocab = weight.size(0);
    TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == vocab),
                "fused loss: the bias must be [", vocab, "], not ", bias.sizes());
    at::Tensor h = hidden.reshape({-1, width});
    at::Tensor t = targets.reshape({-1});
    const int64_t rows = h.size(0);
    TORCH_CHECK(t.size(0) == rows, "fused loss: ", rows, " hidden states but ", t.size(0),
                " targets (flattened: hidden [.., ", width, "] against targets [..])");
    TORCH_CHECK(!at::isFloatingType(t.scalar_type()),
                "fused loss: targets must be class indices (integers), not ", t.scalar_type());
    t = t.to(at::kLong);

    // The matmuls in autocast's dtype where the unfused head would run under it; the softmax
    // in f32 (f64 inputs stay f64).
    const at::DeviceType device_type = hidden.device().type();
    at::ScalarType compute = hidden.scalar_type();
    if (compute != at::kDouble && at::autocast::is_autocast_enabled(device_type)) {
      compute = at::autocast::get_autocast_dtype(device_type);
    }
    const at::ScalarType accumulate = compute == at::kDouble ? at::kDouble : at::kFloat;
    // Casts below are explicit; autocast must not cast again.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);

    const at::Tensor w = weight.to(compute);
    const at::Tensor b = bias.defined() ? bias.to(compute) : at::Tensor();
    // apply() turns grad mode off around forward: the caller's mode says whether gradients
    // will be asked for (an evaluation loss under no_grad computes none).
    const bool need_hidden = grad_enabled && hidden.requires_grad();
    const bool need_weight = grad_enabled && weight.requires_grad();
    const bool need_bias = grad_enabled && bias.defined() && bias.requires_grad();
    const at::ScalarType weight_acc = weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;

    at::Tensor grad_h = need_hidden ? at::empty_like(h) : at::Tensor();
    at::Tensor grad_w = need_weight ? at::zeros(weight.sizes(), weight.options().dtype(weight_acc))
                                    : at::Tensor();
    at::Tensor grad_b = need_bias ? at::zeros({vocab}, bias.options().dtype(weight_acc))
                                  : at::Tensor();
    const at::Tensor valid_all = t.ne(ignore_index);
    // Kept on the device: no synchronisation to read the count. With every target ignored the
    // loss is 0/0 (NaN, as nll_loss's) and the gradients are zero (as its backward's).
    const at::Tensor count = valid_all.sum().to(accumulate);
    const at::Tensor grad_count = count.clamp_min(1);
    at::Tensor loss_sum = at::zeros({}, h.options().dtype(accumulate));

    if (chunk <= 0) chunk = default_chunk(rows, width, vocab);
    for (int64_t start = 0; start < rows; start += chunk) {
      const int64_t len = std::min(chunk, rows - start);
      const at::Tensor hc = h.narrow(0, start, len).to(compute);
      const at::Tensor valid = valid_all.narrow(0, start, len);
      const at::Tensor index = t.narrow(0, start, len).masked_fill(valid.logical_not(), 0).unsqueeze(1);
      at::Tensor logits = b.defined() ? at::addmm(b, hc, w.t()) : at::mm(hc, w.t());
      // One fused log-softmax pass gives the loss (its picked entries) and, exponentiated in
      // place, the softmax: fewer passes over the chunk than logsumexp and softmax apart, and
      // in place, so the chunk's f32 copy is its only f32 buffer.
      at::Tensor log_probs = logits.to(accumulate);
      logits = at::Tensor();
      log_softmax_in_place(log_probs);
      loss_sum.sub_((log_probs.gather(1, index).squeeze(1) * valid).sum());
      if (!(need_hidden || need_weight || need_bias)) continue;
      // d loss / d logits = (softmax - one_hot) * valid / count. The per-row factor is applied
      // to the small side of each matmul (rows × width), not to the chunk's logits.
      at::Tensor probs = log_probs.exp_();
      log_probs = at::Tensor();
      probs.scatter_add_(1, index, at::full({len, 1}, -1.0, probs.options()));
      const at::Tensor grad_logits = probs.to(compute);
      probs = at::Tensor();
      const at::Tensor row_scale = valid.unsqueeze(1).to(accumulate).div_(grad_count);
      if (need_hidden) {
        at::Tensor rows_out = grad_h.narrow(0, start, len);
        rows_out.copy_(at::mm(grad_logits, w).mul_(row_scale));
      }
      const at::Tensor scale_c = row_scale.to(compute);
      if (need_weight) accumulate_product(grad_w, grad_logits.t(), hc * scale_c);
      if (need_bias) grad_b.add_(at::mm(grad_logits.t(), scale_c).squeeze(1));
    }
    // Kept in the dtypes of what they are gradients of.
    if (need_hidden) ctx->saved_data["hidden"] = grad_h.view(hidden.sizes());
    if (need_weight) ctx->saved_data["weight"] = grad_w.to(weight.scalar_type());
    if (need_bias) ctx->saved_data["bias"] = grad_b.to(bias.scalar_type());
    return loss_sum.div_(count);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "fused loss: double backward (create_graph) is not supported: its gradients are "
                "computed in the forward pass, without a graph of their own");
    TORCH_CHECK(!(ctx->saved_data.count("done") > 0),
                "fused loss: backward ran twice through one loss (retain_graph): its gradients "
                "were computed in the forward pass and given away the first time");
    ctx->saved_data["done"] = true;
    const at::Tensor& scale = grad_outputs[0];
    // The gradients were computed for a loss gradient of 1: scale them in place and let go of
    // them.
    auto take = [&](const char* name) -> at::Tensor {
      if (ctx->saved_data.count(name) == 0) return at::Tensor();
      at::Tensor grad = ctx->saved_data[name].toTensor();
      ctx->saved_data.erase(name);
      return grad.mul_(scale);
    };
    at::Tensor grad_hidden = take("hidden");
    at::Tensor grad_weight = take("weight");
    at::Tensor grad_bias = take("bias");
    return {grad_hidden, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

extern "C" {

// The mean cross-entropy of `hidden @ weight^T + bias` against `targets`, fused (see above);
// `bias` may be null, `chunk` <= 0 picks the rows per chunk. Stores a new scalar tensor in `*out`.
int tchmem_fused_linear_cross_entropy(const at::Tensor* hidden, const at::Tensor* weight,
                                      const at::Tensor* bias, const at::Tensor* targets,
                                      int64_t chunk, int64_t ignore_index, at::Tensor** out,
                                      char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        const at::Tensor no_bias = at::empty({0}, weight->options().requires_grad(false));
        TORCH_CHECK(bias == nullptr || bias->numel() > 0, "fused loss: the bias is empty");
        const bool grad_enabled = at::GradMode::is_enabled();
        *out = new at::Tensor(FusedLinearCrossEntropy::apply(
            *hidden, *weight, bias ? *bias : no_bias, *targets, chunk, ignore_index, grad_enabled));
      },
      err, err_len);
}

}  // extern "C"
