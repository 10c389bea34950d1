// The CUDA caching allocator's memory fraction: the share of the device's memory it may reserve
// before it reports out of memory (torch.cuda.set_per_process_memory_fraction). Reached through
// the generic device allocator cast to the CUDA one, as oom_observer.cpp does, so that no
// libc10_cuda symbol is needed at link time; needs CUDA headers, and build.rs compiles this file
// only when they are there.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include "error.h"

namespace {

c10::cuda::CUDACachingAllocator::CUDAAllocator* cuda_allocator() {
  auto* generic = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  TORCH_CHECK(generic != nullptr, "no CUDA allocator is registered");
  return static_cast<c10::cuda::CUDACachingAllocator::CUDAAllocator*>(generic);
}

}  // namespace

extern "C" {

int tchmem_cuda_set_memory_fraction(int device, double fraction, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        cuda_allocator()->setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device));
      },
      err, err_len);
}

int tchmem_cuda_memory_fraction(int device, double* out, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] { *out = cuda_allocator()->getMemoryFraction(static_cast<c10::DeviceIndex>(device)); },
      err, err_len);
}

}  // extern "C"
