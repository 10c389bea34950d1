// Where a checkpointed segment keeps its input between the forward pass and the rerun in
// backward: on the device as it is (the default), quantized to 8 bits with a scale per row, in
// pinned host memory (copied on a side stream while the next segments run, brought back one
// segment ahead of the rerun that needs it), or quantized and on the host.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/TensorImpl.h>

#include <memory>
#include <vector>

namespace tchmem {

// How segment inputs are stored (the `compression` codes the Rust side passes).
enum class Compression : int { None = 0, Int8 = 1, Fp8 = 2 };

struct Keeping {
  bool offload = false;
  Compression compression = Compression::None;

  bool plain() const { return !offload && compression == Compression::None; }
};

class StoredInput {
 public:
  // Keeps `input` as `how` says. With offload on CUDA the copy starts on a side stream, after
  // the work queued so far on the current one; the device memory is freed once it is done.
  void store(const at::Tensor& input, Keeping how);
  // Starts bringing the input back to the device on the side stream (nothing to do when it
  // stayed there, or when a prefetch is under way).
  void prefetch();
  // The input for a rerun, on its device in its dtype, sharing the original's version counter
  // (so that tensors the rerun saves from it carry the versions the forward's did). Waits on the
  // current stream for a copy under way.
  at::Tensor restore();
  // The original input's version now (it changes when the input is modified in place).
  int64_t version() const { return version_.current_version(); }

 private:
  at::Tensor kept_;    // kept as it is
  at::Tensor packed_;  // stored otherwise: quantized and/or on the host
  at::Tensor scale_;   // per-row scales of a quantized input (on the device)
  Compression compression_ = Compression::None;
  at::ScalarType dtype_ = at::kFloat;
  at::Device device_ = at::Device(at::kCPU);
  std::vector<int64_t> original_sizes_;
  c10::VariableVersion version_;
  at::Tensor fetched_;                    // brought back, ready after fetched_event_
  std::unique_ptr<c10::Event> fetched_event_;
};

}  // namespace tchmem
