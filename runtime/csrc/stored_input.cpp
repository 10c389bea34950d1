// Storing checkpointed segments' inputs off the device or quantized (see stored_input.h).
#include "stored_input.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <mutex>

namespace tchmem {
namespace {

// One side stream per device for every copy to and from the host: copies back are then
// ordered after the copies out without events.
c10::Stream side_stream(const at::Device& device) {
  static std::mutex mutex;
  static std::map<int, c10::Stream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = streams.find(device.index());
  if (found != streams.end()) return found->second;
  c10::impl::VirtualGuardImpl guard(device.type());
  c10::Stream stream = guard.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  streams.emplace(device.index(), stream);
  return stream;
}

c10::Stream current_stream(const at::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

// The largest value each format holds: e4m3's 448, int8's 127 (symmetric).
double format_max(Compression c) { return c == Compression::Fp8 ? 448.0 : 127.0; }

// Quantizes rows (the last dimension) with a scale each: absmax / the format's largest value.
std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& x, Compression c) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).to(at::kFloat);
  at::Tensor scale = rows.abs().amax(1, true).div_(format_max(c));
  scale.masked_fill_(scale.eq(0), 1.0);  // all-zero rows
  at::Tensor scaled = rows.div(scale);
  at::Tensor q = c == Compression::Fp8
                     ? scaled.to(at::kFloat8_e4m3fn)
                     : scaled.round_().clamp_(-127, 127).to(at::kChar);
  return {q, scale};
}

at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scale, at::ScalarType dtype,
                      at::IntArrayRef sizes) {
  return q.to(at::kFloat).mul_(scale).to(dtype).view(sizes);
}

}  // namespace

void StoredInput::store(const at::Tensor& input, Keeping how) {
  device_ = input.device();
  dtype_ = input.scalar_type();
  original_sizes_ = input.sizes().vec();
  version_ = torch::autograd::impl::version_counter(input);
  compression_ = how.compression;
  const at::Tensor source = input.detach();
  if (how.plain() || !at::isFloatingType(dtype_) || source.dim() == 0) {
    kept_ = source;
    return;
  }
  auto pack = [&] {
    at::Tensor packed = source;
    if (compression_ != Compression::None) std::tie(packed, scale_) = quantize(source, compression_);
    if (how.offload) {
      at::Tensor host = at::empty(packed.sizes(), packed.options().device(at::kCPU)
                                                      .pinned_memory(device_.is_cuda()));
      host.copy_(packed, /*non_blocking=*/device_.is_cuda());
      packed = host;
    }
    return packed;
  };
  if (!device_.is_cuda()) {
    packed_ = pack();  // a quantized tensor or a host copy: never the input itself
    return;
  }
  // On the side stream, once what the current stream queued (the input itself) is done.
  const c10::Stream main = current_stream(device_);
  const c10::Stream side = side_stream(device_);
  c10::Event produced(device_.type());
  produced.record(main);
  produced.block(side);
  c10::StreamGuard on_side(side);
  packed_ = pack();
  // The input's memory must not be handed out again before the side stream has read it.
  source.record_stream(side);
}

void StoredInput::prefetch() {
  if (kept_.defined() || fetched_.defined() || !packed_.defined()) return;
  auto unpack = [&] {
    at::Tensor here = packed_.device() == device_ ? packed_ : packed_.to(device_, true);
    return compression_ == Compression::None ? here
                                             : dequantize(here, scale_, dtype_, original_sizes_);
  };
  if (!device_.is_cuda()) {
    fetched_ = unpack();
    if (fetched_.is_same(packed_)) fetched_ = packed_.clone();
    return;
  }
  const c10::Stream side = side_stream(device_);
  c10::StreamGuard on_side(side);
  fetched_ = unpack();
  fetched_event_ = std::make_unique<c10::Event>(device_.type());
  fetched_event_->record(side);
}

at::Tensor StoredInput::restore() {
  if (kept_.defined()) return kept_;
  prefetch();
  at::Tensor out = std::move(fetched_);
  fetched_ = at::Tensor();
  if (fetched_event_) {
    const c10::Stream main = current_stream(device_);
    fetched_event_->block(main);
    fetched_event_.reset();
    // Made on the side stream, used and freed on this one.
    out.record_stream(main);
  }
  torch::autograd::impl::set_version_counter(out, version_);
  return out;
}

}  // namespace tchmem
