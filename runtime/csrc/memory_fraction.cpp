// The CUDA caching allocator's memory fraction: the share of the device's memory it may reserve
// before it reports out of memory (torch.cuda.set_per_process_memory_fraction), reached through
// cuda_allocator.h (no libc10_cuda symbol at link time); needs CUDA headers, and build.rs
// compiles this file only when they are there.
#include "cuda_allocator.h"

#include "error.h"

extern "C" {

int tchmem_cuda_set_memory_fraction(int device, double fraction, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        tchmem::cuda_allocator()->setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device));
      },
      err, err_len);
}

int tchmem_cuda_memory_fraction(int device, double* out, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] { *out = tchmem::cuda_allocator()->getMemoryFraction(static_cast<c10::DeviceIndex>(device)); },
      err, err_len);
}

}  // extern "C"
