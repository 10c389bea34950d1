// Activation checkpointing as a libtorch autograd Function (libtorch has no C++ checkpoint API).
// Forward runs a Rust closure without keeping its activations; backward runs it again with grad
// enabled, under the RNG and autocast state of the forward pass, and backpropagates through it.
// Pitfalls found earlier (notes/libtorch.md): inputs go in as a TensorList, backward returns one
// extra undefined gradient for the non-tensor argument, and at least one input must require
// grad, so a zero-element dummy is passed along.
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "error.h"

#include <cstring>
#include <stdexcept>
#include <string>

extern "C" {
// Runs the segment on `input` (Rust takes ownership of it) and returns a new tensor that C++
// takes ownership of, or null after writing why into `err`.
typedef at::Tensor* (*tchmem_segment_call)(void* data, at::Tensor* input, char* err,
                                           size_t err_len);
// Frees the closure.
typedef void (*tchmem_segment_drop)(void* data);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The Rust closure, kept alive by the graph for as long as backward may need it.
struct Segment : torch::CustomClassHolder {
  Segment(void* data, tchmem_segment_call call, tchmem_segment_drop drop)
      : data(data), call(call), drop(drop) {}
  ~Segment() override { drop(data); }

  at::Tensor run(const at::Tensor& input) const {
    // Autocast caches its low-precision copies of weights per thread, keyed by the weight and
    // blind to in-place updates, until the outermost autocast region ends. A segment run from
    // here must not use or fill that cache: the forward runs without grad (a cached copy would
    // carry no graph into a later use of the same weight), and the recompute in backward runs
    // on an autograd thread whose cache nobody clears (later steps would see old weights).
    struct CacheOff {
      bool was = at::autocast::is_autocast_cache_enabled();
      CacheOff() { at::autocast::set_autocast_cache_enabled(false); }
      ~CacheOff() { at::autocast::set_autocast_cache_enabled(was); }
    } cache_off;
    char err[4096] = {0};
    at::Tensor* out = call(data, new at::Tensor(input), err, sizeof err);
    if (out == nullptr) {
      throw std::runtime_error(std::string("a checkpointed segment failed: ") + err);
    }
    at::Tensor result = std::move(*out);
    delete out;
    return result;
  }

  void* data;
  tchmem_segment_call call;
  tchmem_segment_drop drop;
};

// Autocast settings of the two device types that matter here.
struct AutocastState {
  bool cuda_enabled, cpu_enabled;
  at::ScalarType cuda_dtype, cpu_dtype;

  static AutocastState current() {
    return {at::autocast::is_autocast_enabled(at::kCUDA),
            at::autocast::is_autocast_enabled(at::kCPU),
            at::autocast::get_autocast_dtype(at::kCUDA), at::autocast::get_autocast_dtype(at::kCPU)};
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
    at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
  }
};

at::Generator generator_for(const at::Device& device) {
  return at::globalContext().defaultGenerator(device);
}

at::Tensor rng_state(const at::Device& device) {
  auto gen = generator_for(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const at::Device& device, const at::Tensor& state) {
  auto gen = generator_for(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Segment> segment,
                               at::TensorList inputs) {
    const at::Tensor& input = inputs[0];
    ctx->saved_data["segment"] = c10::IValue::make_capsule(segment);
    // Dropout and other random ops must draw the same numbers when recomputed.
    ctx->saved_data["cpu_rng"] = rng_state(at::Device(at::kCPU));
    if (input.is_cuda()) {
      ctx->saved_data["cuda_rng"] = rng_state(input.device());
    }
    auto autocast = AutocastState::current();
    ctx->saved_data["autocast_cuda"] = autocast.cuda_enabled;
    ctx->saved_data["autocast_cpu"] = autocast.cpu_enabled;
    ctx->saved_data["autocast_cuda_dtype"] = static_cast<int64_t>(autocast.cuda_dtype);
    ctx->saved_data["autocast_cpu_dtype"] = static_cast<int64_t>(autocast.cpu_dtype);
    ctx->save_for_backward({input});
    return {segment->run(input)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    auto segment = c10::static_intrusive_pointer_cast<Segment>(ctx->saved_data["segment"].toCapsule());
    at::Tensor input = saved[0].detach();
    input.requires_grad_(saved[0].requires_grad());

    const at::Device cpu(at::kCPU);
    const bool cuda = ctx->saved_data.count("cuda_rng") > 0;
    at::Tensor cpu_now = rng_state(cpu);
    at::Tensor cuda_now = cuda ? rng_state(input.device()) : at::Tensor();
    set_rng_state(cpu, ctx->saved_data["cpu_rng"].toTensor());
    if (cuda) set_rng_state(input.device(), ctx->saved_data["cuda_rng"].toTensor());
    auto autocast_now = AutocastState::current();
    AutocastState{ctx->saved_data["autocast_cuda"].toBool(),
                  ctx->saved_data["autocast_cpu"].toBool(),
                  static_cast<at::ScalarType>(ctx->saved_data["autocast_cuda_dtype"].toInt()),
                  static_cast<at::ScalarType>(ctx->saved_data["autocast_cpu_dtype"].toInt())}
        .apply();

    at::Tensor output;
    try {
      at::AutoGradMode grad(true);
      output = segment->run(input);
    } catch (...) {
      autocast_now.apply();
      set_rng_state(cpu, cpu_now);
      if (cuda) set_rng_state(input.device(), cuda_now);
      throw;
    }
    autocast_now.apply();
    set_rng_state(cpu, cpu_now);
    if (cuda) set_rng_state(input.device(), cuda_now);

    // Gradients of the parameters inside the segment accumulate into their .grad here.
    if (output.requires_grad()) {
      torch::autograd::backward({output}, {grad_outputs[0]});
    }
    at::Tensor input_grad = input.requires_grad() ? input.grad() : at::Tensor();
    // One gradient per argument: the segment (none), the input, the dummy (none).
    return {at::Tensor(), input_grad, at::Tensor()};
  }
};

}  // namespace

extern "C" {

// Runs `call` on `input` as one checkpointed segment and stores the output in `*out` (a new
// tensor owned by the caller). Takes ownership of `data` (freed with `drop`, also on error).
// Without grad mode the segment simply runs. Returns 0, or -1 with a message in `err`.
int tchmem_checkpoint(void* data, tchmem_segment_call call, tchmem_segment_drop drop,
                      const at::Tensor* input, at::Tensor** out, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto segment = c10::make_intrusive<Segment>(data, call, drop);
        if (!at::GradMode::is_enabled()) {
          *out = new at::Tensor(segment->run(*input));
          return;
        }
        at::Tensor dummy = at::empty({0}, at::TensorOptions().device(input->device()));
        dummy.requires_grad_(true);
        auto outputs = CheckpointFunction::apply(segment, at::TensorList({*input, dummy}));
        *out = new at::Tensor(outputs[0]);
      },
      err, err_len);
}

}  // extern "C"
