// A log of the CUDA caching allocator's allocations and frees, fed by a trace tracker the
// allocator calls (alloc_trace.cpp) and marked by the operator recording (op_trace.cpp), so that
// the estimate can replay a run's events through its model of the allocator at another batch.
//
// One log serves the whole process: inside the kernel each cell links its own copy of the shim,
// and the allocator keeps whichever tracker was attached first (trackers cannot be detached). The
// log is made once, its address kept in the runtime's process-wide state, and every copy reaches
// it through that address; all copies are built from this header, so they agree on its layout.
// Needs no CUDA header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tchmem {

struct AllocLog {
  std::mutex mutex;
  bool on = false;
  int device = 0;
  // Allocation `n` bytes: n; free of allocation k: -(k + 1) (see the wire's AllocTrace).
  std::vector<int64_t> events;
  // (operator index or -1 for an end, events before it).
  std::vector<std::pair<int64_t, size_t>> marks;
  // Live allocations by address: their number.
  std::unordered_map<size_t, size_t> live;
  size_t allocations = 0;

  // Starts a fresh log; `in_use` are the addresses of the blocks in use now, which take the
  // first numbers.
  void start(const std::vector<size_t>& in_use, int on_device) {
    std::lock_guard<std::mutex> lock(mutex);
    events.clear();
    marks.clear();
    live.clear();
    allocations = 0;
    for (size_t address : in_use) live[address] = allocations++;
    device = on_device;
    on = true;
  }

  void stop() {
    std::lock_guard<std::mutex> lock(mutex);
    on = false;
    live.clear();
  }

  // Called by the allocator's tracker, under the allocator's own lock.
  void allocated(int on_device, size_t address, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!on || on_device != device) return;
    live[address] = allocations++;
    events.push_back(static_cast<int64_t>(bytes));
  }

  void freed(int on_device, size_t address) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!on || on_device != device) return;
    auto found = live.find(address);
    if (found == live.end()) return;
    events.push_back(-static_cast<int64_t>(found->second) - 1);
    live.erase(found);
  }

  void mark(int64_t op) {
    std::lock_guard<std::mutex> lock(mutex);
    if (on) marks.emplace_back(op, events.size());
  }

  size_t position() {
    std::lock_guard<std::mutex> lock(mutex);
    return events.size();
  }

  // The sizes allocated since event `from`.
  std::vector<int64_t> allocated_since(size_t from) {
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<int64_t> sizes;
    for (size_t i = from; i < events.size(); i++)
      if (events[i] > 0) sizes.push_back(events[i]);
    return sizes;
  }
};

}  // namespace tchmem
