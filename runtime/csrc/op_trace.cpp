// What each operator of one training step allocates, and the same operators run again alone at
// other shapes (the memory estimate's per-op lines, issue #20).
//
// While a recording is on, a global RecordFunction callback notes every top-level operator a
// thread calls (nested calls belong to their caller): its name, its arguments (a tensor by its
// shape and kind only, so nothing is kept alive), the bytes allocated when it began and how far
// above that the allocator went while it ran. The allocator's peak is restarted at each
// operator; the peaks it had before each restart are carried, for the run's own measurement to
// take back (tchmem_ops_take_carried).
//
// Replay builds an operator's arguments at another batch (a dimension that was b1 in one
// recording and b2 in the other is scaled; zero-filled tensors), calls it through the dispatcher
// and measures the same excess: a workspace that cuDNN sizes for the chosen algorithm at that
// shape shows, which a line through two small batches cannot know. An operator that ran on
// another thread than the recording's (autograd's device thread, in a CUDA backward) is replayed
// on that thread: PyTorch keeps cuDNN's benchmark-mode choices per thread, and a replay from the
// caller's thread timed the algorithms afresh and could take another one than the loop's.
//
// Inside the kernel every cell links its own copy of this file: a recording is started and
// stopped by one cell's copy (the trial's), then handed to Rust as a heap object, which the
// runtime's process-wide state keeps for the replay cell's copy. The callback is removed when a
// recording stops, so that no operator pays for it afterwards.
//
// Uses only the generic device allocator interface (no CUDA headers). Nothing unwinds into Rust.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/CachingDeviceAllocator.h>

#include "alloc_log.h"
#include "error.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// An argument as recorded: never a tensor itself (a recording must keep no memory alive).
struct Arg {
  enum class Kind { Value, Tensor, TensorList, OptionalTensorList } kind = Kind::Value;
  c10::IValue value;              // Kind::Value: holds no tensor
  std::vector<int64_t> sizes;     // Kind::Tensor
  // How it lay in memory: its dimensions from outermost to innermost, and those broadcast
  // (stride 0), so that a transposed or expanded input is rebuilt as one.
  std::vector<int64_t> order;
  std::vector<bool> expanded;
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  bool requires_grad = false;     // composite operators choose their kernels by it
  bool none = false;              // an absent item of a Tensor?[] list
  std::vector<Arg> items;         // the lists
};

struct Op {
  c10::OperatorName name{"", ""};
  bool replayable = false;  // its arguments were recorded
  std::vector<Arg> args;
  // The thread's modes when it ran, which decide what it computes (bf16 under autocast, the
  // tensors a composite operator keeps for backward).
  bool grad_enabled = false;
  bool autocast = false;
  c10::ScalarType autocast_dtype = c10::ScalarType::BFloat16;
  // It ran on another thread than the one that started the recording: autograd's device
  // thread, for a CUDA backward's operators.
  bool off_recording_thread = false;
  int64_t start = 0;
  int64_t excess = 0;
};

struct Recording {
  std::vector<Op> ops;
};

std::mutex mutex;  // guards `current`, `handle` and the carried peaks
Recording current;
std::optional<at::CallbackHandle> handle;
// Read by the callbacks on every thread, set before a recording starts.
std::atomic<bool> cuda{false};
std::atomic<c10::DeviceIndex> device{0};
int64_t carried_allocated = 0;
int64_t carried_reserved = 0;
std::atomic<bool> active{false};
// The thread that started the recording (the loop's): written before `active` is set.
std::thread::id recording_thread;
// The process's allocation log, when the recording is to mark it (CUDA): each top-level
// operator's beginning and end.
std::atomic<tchmem::AllocLog*> alloc_log{nullptr};
thread_local int depth = 0;

struct Context : at::ObserverContext {
  bool top = false;
  size_t index = 0;
};

// Thrown by describe for an argument a replay could not rebuild: a view with gaps (a slice),
// a tensor inside a tuple or dictionary. The operator is then recorded without arguments.
struct NotReplayable : std::exception {
  const char* what() const noexcept override { return "not replayable"; }
};

bool holds_tensor(const c10::IValue& v) {
  if (v.isTensor() || v.isTensorList() || v.isGenericDict() || v.isObject()) return true;
  if (v.isList())
    for (const auto& item : v.toListRef())
      if (holds_tensor(item)) return true;
  if (v.isTuple())
    for (const auto& item : v.toTupleRef().elements())
      if (holds_tensor(item)) return true;
  return false;
}

Arg describe_tensor(const at::Tensor& t) {
  Arg arg;
  arg.kind = Arg::Kind::Tensor;
  arg.sizes = t.sizes().vec();
  arg.dtype = t.scalar_type();
  arg.device = t.device();
  arg.requires_grad = t.requires_grad();
  auto strides = t.strides();
  int64_t n = static_cast<int64_t>(arg.sizes.size());
  arg.expanded.assign(n, false);
  std::vector<int64_t> dense, trivial;
  for (int64_t d = 0; d < n; d++) {
    arg.expanded[d] = strides[d] == 0 && arg.sizes[d] > 1;
    (arg.expanded[d] || arg.sizes[d] == 1 ? trivial : dense).push_back(d);
  }
  std::stable_sort(dense.begin(), dense.end(),
                   [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  // Dense up to the order: each dimension's stride is what the inner ones span.
  int64_t span = 1;
  for (auto d = dense.rbegin(); d != dense.rend(); ++d) {
    if (strides[*d] != span) throw NotReplayable();
    span *= arg.sizes[*d];
  }
  arg.order = trivial;
  arg.order.insert(arg.order.end(), dense.begin(), dense.end());
  return arg;
}

Arg describe(const c10::IValue& value) {
  Arg arg;
  if (value.isTensor() && value.toTensor().defined()) {
    return describe_tensor(value.toTensor());
  } else if (value.isTensor()) {
    arg.value = c10::IValue();  // an undefined tensor: None
  } else if (value.isTensorList()) {
    arg.kind = Arg::Kind::TensorList;
    for (const at::Tensor& t : value.toTensorList().vec()) arg.items.push_back(describe_tensor(t));
  } else if (value.isList() && holds_tensor(value)) {
    // Tensor?[] (indexing): tensors and Nones.
    arg.kind = Arg::Kind::OptionalTensorList;
    for (const auto& item : value.toListRef()) {
      if (item.isNone() || (item.isTensor() && !item.toTensor().defined())) {
        Arg none;
        none.none = true;
        arg.items.push_back(none);
      } else if (item.isTensor()) {
        arg.items.push_back(describe_tensor(item.toTensor()));
      } else {
        throw NotReplayable();
      }
    }
  } else if (holds_tensor(value)) {
    throw NotReplayable();
  } else {
    arg.value = value;
  }
  return arg;
}

// Reads the allocator's counters: (current allocated, peak allocated, peak reserved).
struct Counters {
  int64_t current, peak, peak_reserved;
};
Counters counters(c10::DeviceIndex device) {
  auto stats = c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(device);
  return {stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak,
          stats.reserved_bytes[0].peak};
}

// Never throws: the context is returned whatever happens, so that `depth` comes back down.
// Ranges that are no operator (autograd's nodes: `ConvolutionBackward0`) are skipped: the
// operators they call are the top level.
std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!active.load() || !fn.operator_name()) return nullptr;
  auto context = std::make_unique<Context>();
  context->top = depth++ == 0;
  if (!context->top) return context;
  Op op;
  try {
    op.name = *fn.operator_name();
    op.off_recording_thread = std::this_thread::get_id() != recording_thread;
    op.grad_enabled = c10::GradMode::is_enabled();
    op.autocast = at::autocast::is_autocast_enabled(c10::DeviceType::CUDA);
    op.autocast_dtype = at::autocast::get_autocast_dtype(c10::DeviceType::CUDA);
    // Some calls reach the dispatcher without boxed inputs: recorded, never replayed.
    for (const auto& input : fn.inputs()) op.args.push_back(describe(input));
    op.replayable = true;
  } catch (const std::exception&) {
    op.args.clear();
    op.replayable = false;
  }
  try {
    if (cuda) {
      auto now = counters(device);
      c10::getDeviceAllocator(c10::DeviceType::CUDA)->resetPeakStats(device);
      op.start = now.current;
      std::lock_guard<std::mutex> lock(mutex);
      carried_allocated = std::max(carried_allocated, now.peak);
      carried_reserved = std::max(carried_reserved, now.peak_reserved);
    }
    std::lock_guard<std::mutex> lock(mutex);
    context->index = current.ops.size();
    current.ops.push_back(std::move(op));
    if (auto* log = alloc_log.load()) log->mark(static_cast<int64_t>(context->index));
  } catch (const std::exception&) {
    context->index = SIZE_MAX;
  }
  return context;
}

void on_end(const at::RecordFunction&, at::ObserverContext* raw) {
  auto* context = static_cast<Context*>(raw);
  if (context == nullptr) return;
  depth--;
  if (!context->top || !cuda) return;
  try {
    if (auto* log = alloc_log.load()) log->mark(-1);
    auto now = counters(device);
    std::lock_guard<std::mutex> lock(mutex);
    if (context->index < current.ops.size()) {
      auto& op = current.ops[context->index];
      op.excess = std::max<int64_t>(0, now.peak - op.start);
    }
  } catch (const std::exception&) {
  }
}

// A dimension `d1` in the recording at `b1` and `d2` at `b2`, at `target`: scaled when it moved
// with the batch (d1/b1 == d2/b2), else as it was; a replay at a batch it does not divide into
// whole sizes is refused.
int64_t scaled(int64_t d1, int64_t d2, int64_t b1, int64_t b2, int64_t target) {
  if (d1 == d2 || d1 * b2 != d2 * b1) return d1;
  TORCH_CHECK(d1 * target % b1 == 0, "a size of ", d1, " at batch ", b1,
              " has no whole size at batch ", target);
  return d1 * target / b1;
}

// A zero-filled tensor as `a1` lay in memory (its dimensions' order, the broadcast ones), at the
// sizes the two recordings scale to at `target`.
at::Tensor rebuild_tensor(const Arg& a1, const Arg& a2, int64_t b1, int64_t b2, int64_t target) {
  TORCH_CHECK(a2.kind == Arg::Kind::Tensor && a2.sizes.size() == a1.sizes.size(),
              "the two recordings' arguments differ");
  size_t n = a1.sizes.size();
  std::vector<int64_t> sizes, stored, back(n);
  for (size_t d = 0; d < n; d++) sizes.push_back(scaled(a1.sizes[d], a2.sizes[d], b1, b2, target));
  for (size_t i = 0; i < n; i++) {
    int64_t d = a1.order[i];
    stored.push_back(a1.expanded[d] ? 1 : sizes[d]);
    back[d] = static_cast<int64_t>(i);
  }
  auto tensor = at::zeros(stored, at::TensorOptions().dtype(a1.dtype).device(a1.device));
  if (a1.requires_grad && tensor.is_floating_point()) tensor.requires_grad_(true);
  tensor = tensor.permute(back);
  if (std::find(a1.expanded.begin(), a1.expanded.end(), true) != a1.expanded.end())
    tensor = tensor.expand(sizes);
  return tensor;
}

c10::IValue rebuild(const Arg& a1, const Arg& a2, int64_t b1, int64_t b2, int64_t target) {
  bool lists = a1.kind == Arg::Kind::TensorList || a1.kind == Arg::Kind::OptionalTensorList;
  TORCH_CHECK(a1.kind == a2.kind && (!lists || a1.items.size() == a2.items.size()),
              "the two recordings' arguments differ");
  switch (a1.kind) {
    case Arg::Kind::Tensor:
      return rebuild_tensor(a1, a2, b1, b2, target);
    case Arg::Kind::TensorList: {
      c10::List<at::Tensor> list;
      for (size_t i = 0; i < a1.items.size(); i++)
        list.push_back(rebuild_tensor(a1.items[i], a2.items[i], b1, b2, target));
      return list;
    }
    case Arg::Kind::OptionalTensorList: {
      c10::List<std::optional<at::Tensor>> list;
      for (size_t i = 0; i < a1.items.size(); i++) {
        if (a1.items[i].none)
          list.push_back(std::nullopt);
        else
          list.push_back(rebuild_tensor(a1.items[i], a2.items[i], b1, b2, target));
      }
      return list;
    }
    case Arg::Kind::Value:
      break;
  }
  const auto& v1 = a1.value;
  const auto& v2 = a2.value;
  if (v1.isInt() && v2.isInt()) return scaled(v1.toInt(), v2.toInt(), b1, b2, target);
  if (v1.isIntList() && v2.isIntList()) {
    auto l1 = v1.toIntVector();
    auto l2 = v2.toIntVector();
    if (l1.size() == l2.size()) {
      std::vector<int64_t> out;
      for (size_t i = 0; i < l1.size(); i++) out.push_back(scaled(l1[i], l2[i], b1, b2, target));
      return out;
    }
  }
  return v1;
}

// One operator run alone at `target`: its excess over what was allocated when it began (0
// without CUDA: the operator only runs). It runs twice and the second run counts: the first
// may make what a library creates once and keeps (cuBLAS's and cuBLASLt's workspaces for this
// thread, cuDNN's handle), which the trial's step found made by the steps before it.
int64_t replay_one(const Op& o1, const Op& o2, int64_t b1, int64_t b2, int64_t target,
                   bool cuda, c10::DeviceIndex device, tchmem::AllocLog* log,
                   std::vector<int64_t>& sizes) {
  TORCH_CHECK(o1.replayable && o2.replayable && o1.name == o2.name &&
                  o1.args.size() == o2.args.size(),
              "the two recordings' operators differ");
  auto operation = c10::Dispatcher::singleton().findSchema(o1.name);
  TORCH_CHECK(operation.has_value(), "no operator ", o1.name.name);
  // The modes it ran under, put back as they were afterwards.
  c10::AutoGradMode grad_mode(o1.grad_enabled);
  struct AutocastAs {
    bool enabled;
    c10::ScalarType dtype;
    explicit AutocastAs(const Op& op)
        : enabled(at::autocast::is_autocast_enabled(c10::DeviceType::CUDA)),
          dtype(at::autocast::get_autocast_dtype(c10::DeviceType::CUDA)) {
      at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, op.autocast_dtype);
      at::autocast::set_autocast_enabled(c10::DeviceType::CUDA, op.autocast);
    }
    ~AutocastAs() {
      at::autocast::set_autocast_enabled(c10::DeviceType::CUDA, enabled);
      at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, dtype);
      at::autocast::clear_cache();
    }
  } autocast(o1);
  int64_t excess = 0;
  for (int run = 0; run < (cuda ? 2 : 1); run++) {
    torch::jit::Stack stack;
    for (size_t i = 0; i < o1.args.size(); i++)
      stack.push_back(rebuild(o1.args[i], o2.args[i], b1, b2, target));
    if (!cuda) {
      operation->callBoxed(stack);
      return 0;
    }
    // Autocast's copies of the first run are not the second's to find.
    at::autocast::clear_cache();
    int64_t start = counters(device).current;
    c10::getDeviceAllocator(c10::DeviceType::CUDA)->resetPeakStats(device);
    size_t from = log ? log->position() : 0;
    operation->callBoxed(stack);
    excess = std::max<int64_t>(0, counters(device).peak - start);
    if (log) sizes = log->allocated_since(from);
  }
  return excess;
}

// Runs `body` on the thread autograd runs a backward of `device`'s tensors on, and waits: a
// tensor's hook in a one-multiply backward. What `body` throws is thrown here.
void on_autograd_thread(c10::DeviceIndex device, const std::function<void()>& body) {
  c10::AutoGradMode grad_mode(true);
  auto options = at::TensorOptions().device(c10::Device(c10::DeviceType::CUDA, device));
  auto leaf = at::zeros({1}, options).requires_grad_(true);
  auto product = leaf * 2;  // not a leaf: its hook runs inside the backward
  std::exception_ptr failed;
  product.register_hook([&](const at::Tensor&) {
    try {
      body();
    } catch (...) {
      failed = std::current_exception();
    }
  });
  product.sum().backward();
  if (failed) std::rethrow_exception(failed);
}

std::string signature(const Op& op) {
  // The thread too: a checkpointed segment's forward runs again in backward, on autograd's.
  std::string key = op.name.name + "." + op.name.overload_name + "|" +
                    std::to_string(op.grad_enabled) + std::to_string(op.autocast) +
                    std::to_string(static_cast<int>(op.autocast_dtype)) +
                    std::to_string(op.off_recording_thread);
  std::function<void(const Arg&)> add = [&](const Arg& a) {
    switch (a.kind) {
      case Arg::Kind::Tensor:
        key += "|T" + std::to_string(static_cast<int>(a.dtype)) + std::to_string(a.requires_grad);
        for (size_t d = 0; d < a.sizes.size(); d++)
          key += "," + std::to_string(a.sizes[d]) + (a.expanded[d] ? "e" : "") + ":" +
                 std::to_string(a.order[d]);
        break;
      case Arg::Kind::TensorList:
      case Arg::Kind::OptionalTensorList:
        key += "|[";
        for (const auto& item : a.items) {
          if (item.none)
            key += "|None";
          else
            add(item);
        }
        key += "]";
        break;
      case Arg::Kind::Value: {
        std::ostringstream text;
        text << a.value;
        key += "|" + text.str();
      }
    }
  };
  for (const auto& a : op.args) add(a);
  return key;
}

}  // namespace

extern "C" {

// Starts recording the operators every thread calls; `with_cuda`: measure the CUDA allocator
// of `device_index` (otherwise only names and arguments). `callback` gets the callback's
// handle, for tchmem_ops_remove if the recording is never stopped. `log` (an AllocLog, or null)
// is marked where each top-level operator begins and ends.
int tchmem_ops_start(int with_cuda, int device_index, void* log, uint64_t* callback, char* err,
                     size_t err_len) {
  return tchmem::guarded(
      [&] {
        // An earlier recording that was never stopped left the callbacks reading.
        active.store(false);
        std::lock_guard<std::mutex> lock(mutex);
        // A handle of an earlier recording may have been removed already (tchmem_ops_remove);
        // removing it again is nothing to libtorch.
        if (handle) at::removeCallback(*handle);
        handle = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                                           .needsInputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
        cuda.store(with_cuda != 0);
        device.store(static_cast<c10::DeviceIndex>(device_index));
        current = Recording{};
        recording_thread = std::this_thread::get_id();
        *callback = *handle;
        alloc_log.store(with_cuda != 0 ? static_cast<tchmem::AllocLog*>(log) : nullptr);
        active.store(true);
      },
      err, err_len);
}

// Stops recording and removes the callback; `recording` gets the recording (free it with
// tchmem_ops_free), `count` its operators.
int tchmem_ops_stop(void** recording, size_t* count, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        active.store(false);
        alloc_log.store(nullptr);
        std::lock_guard<std::mutex> lock(mutex);
        if (handle) {
          at::removeCallback(*handle);
          handle.reset();
        }
        auto* kept = new Recording(std::move(current));
        current = Recording{};
        *count = kept->ops.size();
        *recording = kept;
      },
      err, err_len);
}

// Removes the callback of a recording that was never stopped (its cell failed first): any
// cell's copy may, the handle is libtorch's.
void tchmem_ops_remove(uint64_t callback) { at::removeCallback(callback); }

// Frees a recording tchmem_ops_stop returned.
void tchmem_ops_free(void* recording) { delete static_cast<Recording*>(recording); }

// Operator `index` of `recording`: its name (NUL-terminated, cut to `name_len`), the bytes
// allocated when it began and its excess.
int tchmem_ops_get(const void* recording, size_t index, char* name, size_t name_len,
                   int64_t* start, int64_t* excess, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        const auto* r = static_cast<const Recording*>(recording);
        TORCH_CHECK(index < r->ops.size(), "no operator ", index);
        const Op& op = r->ops[index];
        std::string text = op.name.name;
        if (!op.name.overload_name.empty()) text += "." + op.name.overload_name;
        tchmem::write_error(text.c_str(), name, name_len);
        *start = op.start;
        *excess = op.excess;
      },
      err, err_len);
}

// The allocator's peaks the recording restarted since the last call (0 when none), and
// forgets them: the run's measurement takes them back into its own peaks.
void tchmem_ops_take_carried(int64_t* allocated, int64_t* reserved) {
  std::lock_guard<std::mutex> lock(mutex);
  *allocated = carried_allocated;
  *reserved = carried_reserved;
  carried_allocated = 0;
  carried_reserved = 0;
}

// Runs operators of `first` (recorded at batch b1; `second`, at b2, tells which dimensions grow
// with the batch) alone at batch `target`, `count` of them given in `pairs` as (index in
// `first`, index in `second`), on the CUDA allocator of
// `device_index` when `with_cuda`; `excess[i]` gets each one's excess, or -1 when it could not
// run (the estimate then keeps the operator's line). With `log` (an AllocLog, on CUDA), `sizes`
// gets, for each i, what the operator allocated while it ran. Operators with the same arguments
// run once.
int tchmem_ops_replay(const void* first, const void* second, int64_t b1, int64_t b2,
                      int64_t target, const size_t* pairs, size_t count, int with_cuda,
                      int device_index, int64_t* excess, void* log, void* context,
                      void (*sizes)(void* context, size_t i, const int64_t* bytes, size_t n),
                      char* err, size_t err_len) {
  auto* allocations = with_cuda != 0 ? static_cast<tchmem::AllocLog*>(log) : nullptr;
  if (allocations) allocations->start({}, device_index);
  int status = tchmem::guarded(
      [&] {
        const auto* r1 = static_cast<const Recording*>(first);
        const auto* r2 = static_cast<const Recording*>(second);
        auto on = static_cast<c10::DeviceIndex>(device_index);
        std::map<std::string, std::pair<int64_t, std::vector<int64_t>>> done;
        for (size_t i = 0; i < count; i++) {
          // The same operator in the two recordings: their indices differ where one step ran
          // operators the other did not (one per sample, say).
          size_t k1 = pairs[2 * i];
          size_t k2 = pairs[2 * i + 1];
          TORCH_CHECK(k1 < r1->ops.size() && k2 < r2->ops.size(), "no operator ", k1, "/", k2);
          const Op& o1 = r1->ops[k1];
          const Op& o2 = r2->ops[k2];
          std::string key = signature(o1) + "/" + signature(o2);
          auto found = done.find(key);
          if (found == done.end()) {
            int64_t value = -1;
            std::vector<int64_t> allocated;
            try {
              auto replay = [&] {
                value = replay_one(o1, o2, b1, b2, target, with_cuda != 0, on, allocations,
                                   allocated);
              };
              if (with_cuda != 0 && o1.off_recording_thread)
                on_autograd_thread(on, replay);
              else
                replay();
            } catch (const std::exception&) {
              value = -1;
              allocated.clear();
            }
            if (with_cuda != 0) c10::getDeviceAllocator(c10::DeviceType::CUDA)->emptyCache();
            found = done.emplace(key, std::make_pair(value, std::move(allocated))).first;
          }
          excess[i] = found->second.first;
          if (allocations) sizes(context, i, found->second.second.data(), found->second.second.size());
        }
      },
      err, err_len);
  if (allocations) allocations->stop();
  return status;
}

}  // extern "C"
