// How long the device worked during part of a run (issue #20): libtorch's kineto profiler with
// the device's activity only (kernels, copies and memsets as CUPTI reports them), and the length
// of the union of their intervals. A step's wall time at a small batch is mostly the host
// launching kernels (launch-bound) and barely grows with the batch; the device's work does.
//
// The profiler's state is libtorch's, not this file's: a profile one cell's copy of this file
// starts, another cell's copy may stop. Nothing unwinds into Rust.
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/api.h>
#include <kineto/ActivityType.h>

#include "error.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

namespace {

using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

// The device's activity (`device` != 0) or, where there is none (tests on a CPU machine), the
// host's operators: the same profiler, start, stop and sum.
std::set<ActivityType> activities(int device) {
  return {device != 0 ? ActivityType::CUDA : ActivityType::CPU};
}

// Whether a profiler event is work of the kind asked for, on device `index` for the device's.
// GPU user annotations are ranges around kernels, gaps included, so they do not count.
bool counts(const torch::autograd::profiler::KinetoEvent& event, int device, int index) {
  const auto kind = static_cast<libkineto::ActivityType>(event.activityType());
  if (device == 0) return kind == libkineto::ActivityType::CPU_OP;
  return event.deviceIndex() == index &&
         (kind == libkineto::ActivityType::CONCURRENT_KERNEL ||
          kind == libkineto::ActivityType::GPU_MEMCPY ||
          kind == libkineto::ActivityType::GPU_MEMSET);
}

// The length of the union of [start, end) intervals: kernels on several streams overlap.
uint64_t union_length(std::vector<std::pair<uint64_t, uint64_t>> spans) {
  std::sort(spans.begin(), spans.end());
  uint64_t total = 0, start = 0, end = 0;
  bool open = false;
  for (const auto& [s, e] : spans) {
    if (open && s <= end) {
      end = std::max(end, e);
      continue;
    }
    if (open) total += end - start;
    start = s;
    end = e;
    open = true;
  }
  if (open) total += end - start;
  return total;
}

}  // namespace

extern "C" {

// Starts the profiler on `device` activity (1) or the host's operators (0). Its set-up (CUPTI's,
// on the device) happens here, before the part to measure. The profiler is per thread: the
// same thread stops it.
int tchmem_busy_start(int device, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        TORCH_CHECK(!torch::profiler::impl::profilerEnabled(), "a profiler is already on");
        const ProfilerConfig config(ProfilerState::KINETO);
        torch::autograd::profiler::prepareProfiler(config, activities(device));
        torch::autograd::profiler::enableProfiler(config, activities(device));
      },
      err, err_len);
}

// Stops the profiler; `busy_ns` gets the union of its events' intervals of the kind asked for
// (on device `index`), `events` how many there were.
int tchmem_busy_stop(int device, int index, uint64_t* busy_ns, size_t* events, char* err,
                     size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto result = torch::autograd::profiler::disableProfiler();
        std::vector<std::pair<uint64_t, uint64_t>> spans;
        if (result) {
          for (const auto& event : result->events()) {
            if (counts(event, device, index) && event.endNs() > event.startNs()) {
              spans.emplace_back(event.startNs(), event.endNs());
            }
          }
        }
        *events = spans.size();
        *busy_ns = union_length(std::move(spans));
      },
      err, err_len);
}

// Stops a profile this thread left on (a trial interrupted or failed in its profiled step),
// discarding it: a profiler left on would trace every later kernel and refuse every later start.
void tchmem_busy_abandon() {
  try {
    if (torch::profiler::impl::profilerEnabled()) torch::autograd::profiler::disableProfiler();
  } catch (...) {
  }
}

}  // extern "C"
