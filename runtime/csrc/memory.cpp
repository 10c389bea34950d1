// The part of libtorch's C++ API that tch does not expose: the CUDA caching allocator's
// statistics. Only the generic c10::DeviceAllocator interface is used, so no CUDA headers are
// needed. Every function catches C++ exceptions and reports them as text: nothing may unwind
// into Rust.
#include <c10/core/CachingDeviceAllocator.h>

#include "error.h"

#include <cstdint>

extern "C" {

struct TchmemStat {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
};

struct TchmemDeviceStats {
  TchmemStat allocated_bytes;
  TchmemStat reserved_bytes;
  TchmemStat active_bytes;
  TchmemStat requested_bytes;
  TchmemStat inactive_split_bytes;
  TchmemStat allocation;
  TchmemStat segment;
  int64_t num_alloc_retries;
  int64_t num_ooms;
  int64_t num_device_alloc;
  int64_t num_device_free;
};

}  // extern "C"

namespace {

// Index 0 of a StatArray is the aggregate over the small and large pools.
TchmemStat convert(const c10::CachingAllocator::StatArray& stats) {
  const auto& s = stats[0];
  return TchmemStat{s.current, s.peak, s.allocated, s.freed};
}

c10::DeviceAllocator* cuda_allocator() {
  return c10::getDeviceAllocator(c10::DeviceType::CUDA);
}

}  // namespace

extern "C" {

int tchmem_cuda_device_stats(int device, TchmemDeviceStats* out, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto stats = cuda_allocator()->getDeviceStats(static_cast<c10::DeviceIndex>(device));
        out->allocated_bytes = convert(stats.allocated_bytes);
        out->reserved_bytes = convert(stats.reserved_bytes);
        out->active_bytes = convert(stats.active_bytes);
        out->requested_bytes = convert(stats.requested_bytes);
        out->inactive_split_bytes = convert(stats.inactive_split_bytes);
        out->allocation = convert(stats.allocation);
        out->segment = convert(stats.segment);
        out->num_alloc_retries = stats.num_alloc_retries;
        out->num_ooms = stats.num_ooms;
        out->num_device_alloc = stats.num_device_alloc;
        out->num_device_free = stats.num_device_free;
      },
      err, err_len);
}

int tchmem_cuda_reset_peak_stats(int device, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] { cuda_allocator()->resetPeakStats(static_cast<c10::DeviceIndex>(device)); }, err,
      err_len);
}

int tchmem_cuda_memory_info(int device, uint64_t* free_bytes, uint64_t* total_bytes, char* err,
                            size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto info = cuda_allocator()->getMemoryInfo(static_cast<c10::DeviceIndex>(device));
        *free_bytes = info.first;
        *total_bytes = info.second;
      },
      err, err_len);
}

int tchmem_cuda_empty_cache(char* err, size_t err_len) {
  return tchmem::guarded([&] { cuda_allocator()->emptyCache(); }, err, err_len);
}

}  // extern "C"
