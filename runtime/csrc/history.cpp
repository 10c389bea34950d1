// libtorch's allocation history: the CUDA caching allocator's trace of every alloc and free (the
// data PyTorch's `torch.cuda.memory._record_memory_history` keeps), the snapshot pickle that
// PyTorch's memory_viz reads, and the user metadata the allocator stamps on each trace entry
// (tchmem writes the training phase there).
//
// `_record_memory_history` and `_memory_snapshot_pickled` live in libtorch_cuda, which cells do
// not link (the kernel's child loads it at run time): they are looked up in the process by their
// mangled names, which are libtorch 2.11's (tch 0.24 pins that version). The metadata setter is
// a virtual method of the allocator, as the OOM observer is (no libc10_cuda symbol needed).
#include "cuda_allocator.h"

#include <dlfcn.h>

#include <optional>
#include <string>
#include <vector>

#include "error.h"

namespace {

using RecordHistoryFn = void (*)(std::optional<std::string> enabled,
                                 std::optional<std::string> context, const std::string& stacks,
                                 size_t max_entries, bool clear_history, bool compile_context,
                                 bool global_record_allocations,
                                 const std::vector<std::string>& skip_actions);
using SnapshotPickledFn = std::string (*)();

// torch::cuda::_record_memory_history(optional<string>, optional<string>, const string&, size_t,
// bool, bool, bool, const vector<string>&) and torch::cuda::_memory_snapshot_pickled().
constexpr const char* kRecordHistory =
    "_ZN5torch4cuda22_record_memory_historyESt8optionalINSt7__cxx1112basic_stringIcSt11char_"
    "traitsIcESaIcEEEES8_RKS7_mbbbRKSt6vectorIS7_SaIS7_EE";
constexpr const char* kSnapshotPickled = "_ZN5torch4cuda24_memory_snapshot_pickledB5cxx11Ev";

template <typename F>
F find(const char* symbol) {
  void* found = dlsym(RTLD_DEFAULT, symbol);
  TORCH_CHECK(found != nullptr,
              "libtorch_cuda's allocation history is not loaded in this process (",
              symbol, "): it needs libtorch with CUDA, version 2.11");
  return reinterpret_cast<F>(found);
}

}  // namespace

extern "C" {

// Starts recording every alloc and free (and segment event) into a ring of `max_entries`. With
// `stacks`, each allocation also keeps its C++ stack (PyTorch's context "alloc", stacks "all");
// without, no stack is gathered at all (the cheap mode).
int tchmem_history_start(size_t max_entries, int stacks, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto record = find<RecordHistoryFn>(kRecordHistory);
        std::optional<std::string> context;
        if (stacks) context = "alloc";
        record("all", context, stacks ? "all" : "python", max_entries,
               /*clear_history=*/true, /*compile_context=*/false,
               /*global_record_allocations=*/false, {});
      },
      err, err_len);
}

// Stops recording (the trace recorded so far stays until the next start).
int tchmem_history_stop(char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto record = find<RecordHistoryFn>(kRecordHistory);
        record(std::nullopt, std::nullopt, "all", 0, false, false, false, {});
      },
      err, err_len);
}

// The snapshot (segments and the recorded trace) as PyTorch's pickle, handed to `sink`.
int tchmem_history_snapshot(void (*sink)(void* context, const char* data, size_t len),
                            void* context, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto pickled = find<SnapshotPickledFn>(kSnapshotPickled)();
        sink(context, pickled.data(), pickled.size());
      },
      err, err_len);
}

// Sets the text the allocator stamps on later trace entries (`user_metadata`).
int tchmem_history_set_metadata(const char* text, char* err, size_t err_len) {
  return tchmem::guarded([&] { tchmem::cuda_allocator()->setUserMetadata(text); }, err, err_len);
}

}  // extern "C"
