// The allocator's events over a run (alloc_log.h): the log made once per process with a trace
// tracker attached to the CUDA caching allocator, the segments it holds when a run begins, and
// the log read back. The tracker sees every alloc and free the allocator serves (it is called
// whether or not the allocation history is recorded), and adds to the log only while it is on.
#include <ATen/ATen.h>

#include "alloc_log.h"
#include "cuda_allocator.h"
#include "error.h"

#include <cstring>

namespace {

using c10::CachingDeviceAllocator::TraceEntry;

}  // namespace

extern "C" {

// Makes the process's log and attaches the allocator's tracker that feeds it; `log` gets it.
// Called once per process (the runtime keeps the address).
int tchmem_alloc_log_new(int device, void** log, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        // The allocator attaches trackers to the devices it has set up: set up this one first.
        at::empty({1}, at::TensorOptions().device(c10::Device(c10::DeviceType::CUDA,
                                                                static_cast<c10::DeviceIndex>(device))));
        auto* made = new tchmem::AllocLog();
        tchmem::cuda_allocator()->attachAllocatorTraceTracker([made](const TraceEntry& entry) {
          if (entry.action_ == TraceEntry::ALLOC)
            made->allocated(entry.device_, entry.addr_, entry.size_);
          else if (entry.action_ == TraceEntry::FREE_COMPLETED)
            made->freed(entry.device_, entry.addr_);
        });
        *log = made;
      },
      err, err_len);
}

// Starts `log` afresh on `device`, and hands `segment` each segment the allocator holds there
// now (default pool, not expandable): whether it is in the large pool, and its blocks' sizes and
// whether each is in use, in address order. Fails on expandable segments, whose rules differ.
int tchmem_alloc_log_start(void* log, int device, void* context,
                           void (*segment)(void* context, int large, const uint64_t* sizes,
                                           const uint8_t* in_use, size_t count),
                           char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto snapshot = tchmem::cuda_allocator()->snapshot({0, 0}, false);
        std::vector<size_t> in_use_addresses;
        for (const auto& s : snapshot.segments) {
          if (s.device != device) continue;
          TORCH_CHECK(!s.is_expandable,
                      "expandable segments: the allocator's rules are not the ones modelled");
          if (s.owner_private_pool_id.first != 0 || s.owner_private_pool_id.second != 0) continue;
          std::vector<uint64_t> sizes;
          std::vector<uint8_t> in_use;
          size_t address = s.address;
          for (const auto& b : s.blocks) {
            sizes.push_back(b.size);
            in_use.push_back(b.allocated ? 1 : 0);
            if (b.allocated) in_use_addresses.push_back(address);
            address += b.size;
          }
          segment(context, s.is_large ? 1 : 0, sizes.data(), in_use.data(), sizes.size());
        }
        static_cast<tchmem::AllocLog*>(log)->start(in_use_addresses, device);
      },
      err, err_len);
}

// Stops `log` and hands its events and marks to `sink`.
void tchmem_alloc_log_stop(void* log, void* context,
                           void (*sink)(void* context, const int64_t* events, size_t count,
                                        const int64_t* marks, size_t mark_count)) {
  auto* l = static_cast<tchmem::AllocLog*>(log);
  l->stop();
  std::lock_guard<std::mutex> lock(l->mutex);
  std::vector<int64_t> flat;
  for (const auto& [op, at] : l->marks) {
    flat.push_back(op);
    flat.push_back(static_cast<int64_t>(at));
  }
  sink(context, l->events.data(), l->events.size(), flat.data(), l->marks.size());
  l->events.clear();
  l->marks.clear();
}

}  // extern "C"
