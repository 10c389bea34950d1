// The CUDA caching allocator, reached through the generic device allocator cast to the CUDA one:
// its virtual methods need no libc10_cuda symbol at link time (cells do not link libtorch_cuda;
// the vtable slots come from the headers, which build.rs takes from the same torch as
// torch-sys). Needs CUDA headers: only the files build.rs compiles when they are there include it.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>

namespace tchmem {

inline c10::cuda::CUDACachingAllocator::CUDAAllocator* cuda_allocator() {
  auto* generic = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  TORCH_CHECK(generic != nullptr, "no CUDA allocator is registered");
  return static_cast<c10::cuda::CUDACachingAllocator::CUDAAllocator*>(generic);
}

}  // namespace tchmem
