// libtorch's out-of-memory observer: called by the CUDA caching allocator (after it released its
// lock) when it gives up on a request (the same moment it counts `num_ooms`), with the request's size and
// what was free on the device at that moment. Needs CUDA headers (crt/ comes from the nvidia-cuda-crt
// wheel); build.rs compiles this file only when they are there.
#include "cuda_allocator.h"

#include "error.h"

extern "C" {

typedef void (*tchmem_oom_callback)(int64_t device, uint64_t requested, uint64_t device_total,
                                    uint64_t device_free);

// Attaches `callback` as an observer. Reached through the generic device allocator and its
// virtual methods, so that no libc10_cuda symbol is needed at link time. The vtable slot comes
// from the headers: they must be the loaded libtorch's (build.rs takes them from the same
// torch as torch-sys, whose version tch pins).
int tchmem_attach_oom_observer(tchmem_oom_callback callback, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        tchmem::cuda_allocator()->attachOutOfMemoryObserver(
            [callback](int64_t device, size_t requested, size_t total, size_t free) {
              callback(device, requested, total, free);
            });
      },
      err, err_len);
}

}  // extern "C"
