// Activation checkpointing (libtorch has no C++ checkpoint API), the way PyTorch's non-reentrant
// checkpoint works: the segment's forward runs with grad and builds its graph as usual, but every
// tensor that graph saves for backward is replaced by a placeholder. The first placeholder
// unpacked in backward runs the segment again, under the forward's RNG and autocast state, and
// collects the tensors in the order they were saved, stopping the rerun as soon as the last one
// is in: the ops after it (in a transformer block, the whole last matmul) are not recomputed.
// Backward then goes through the forward's own graph, so `run_backward(…, inputs)` works.
//
// libtorch asks for saved-tensor hooks only through its autograd engine
// (Engine::get_default_saved_variable_hooks, which gives none outside Python), so this file
// installs an engine that answers that one question and passes all work to libtorch's.
//
// Stopping a rerun early throws from inside an op the Rust closure called; tch turns that into an
// error, the closure panics, and the Rust side catches the panic (the panic hook keeps quiet about
// it: see RECOMPUTE_COMPLETE).
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/input_buffer.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include "error.h"
#include "stored_input.h"

#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" {
// Runs the segment on `input` (Rust takes ownership of it) and returns a new tensor that C++
// takes ownership of, or null after writing why into `err`.
typedef at::Tensor* (*tchmem_segment_call)(void* data, at::Tensor* input, char* err,
                                           size_t err_len);
// Frees the closure.
typedef void (*tchmem_segment_drop)(void* data);
}

namespace {

using torch::autograd::SavedVariableHooks;

// The message of the exception that stops a rerun; checkpoint.rs knows it too.
constexpr const char* RECOMPUTE_COMPLETE = "tchmem: checkpoint recompute complete";

struct RecomputeComplete : std::exception {
  const char* what() const noexcept override { return RECOMPUTE_COMPLETE; }
};

// The Rust closure.
struct Segment {
  Segment(void* data, tchmem_segment_call call, tchmem_segment_drop drop)
      : data(data), call(call), drop(drop) {}
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() { drop(data); }

  at::Tensor run(const at::Tensor& input) const {
    // Autocast caches its low-precision copies of weights per thread, keyed by the weight and
    // blind to in-place updates, until the outermost autocast region ends. A segment must not
    // use or fill that cache: in the forward it would keep copies alive that the placeholders
    // are there to free, and the rerun in backward runs on an autograd thread whose cache nobody
    // clears (later steps would see old weights).
    struct CacheOff {
      bool was = at::autocast::is_autocast_cache_enabled();
      CacheOff() { at::autocast::set_autocast_cache_enabled(false); }
      ~CacheOff() { at::autocast::set_autocast_cache_enabled(was); }
    } cache_off;
    char err[4096] = {0};
    at::Tensor* out = call(data, new at::Tensor(input), err, sizeof err);
    if (out == nullptr) {
      throw std::runtime_error(std::string("a checkpointed segment failed: ") + err);
    }
    at::Tensor result = std::move(*out);
    delete out;
    return result;
  }

  void* data;
  tchmem_segment_call call;
  tchmem_segment_drop drop;
};

// Autocast settings of the two device types that matter here, with oneDNN's switch, which
// `tchmem::amp::autocast_on` turns off under CPU autocast where oneDNN lacks the dtype (the rerun
// must take the kernels the forward took).
struct AutocastState {
  bool cuda_enabled, cpu_enabled;
  at::ScalarType cuda_dtype, cpu_dtype;
  bool onednn;

  static AutocastState current() {
    return {at::autocast::is_autocast_enabled(at::kCUDA),
            at::autocast::is_autocast_enabled(at::kCPU),
            at::autocast::get_autocast_dtype(at::kCUDA), at::autocast::get_autocast_dtype(at::kCPU),
            at::globalContext().userEnabledMkldnn()};
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
    at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::globalContext().setUserEnabledMkldnn(onednn);
  }
};

at::Tensor rng_state(const at::Device& device) {
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const at::Device& device, const at::Tensor& state) {
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// The RNG and autocast state a segment ran under.
struct RunState {
  at::Device device;
  at::Tensor cpu_rng, cuda_rng;
  AutocastState autocast;

  static RunState current(const at::Device& device) {
    RunState s{device, rng_state(at::Device(at::kCPU)), at::Tensor(), AutocastState::current()};
    if (device.is_cuda()) s.cuda_rng = rng_state(device);
    return s;
  }

  void apply() const {
    set_rng_state(at::Device(at::kCPU), cpu_rng);
    if (cuda_rng.defined()) set_rng_state(device, cuda_rng);
    autocast.apply();
  }
};

// Applies a RunState until it ends, then restores the one before.
struct RunStateGuard {
  RunState before;
  explicit RunStateGuard(const RunState& target) : before(RunState::current(target.device)) {
    target.apply();
  }
  ~RunStateGuard() { before.apply(); }
};

void use_this_copys_engine();

// What a saved tensor looked like when packed, to check that the rerun saves the same ones.
struct SavedShape {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  at::Device device;
  int64_t version;

  static SavedShape of(const at::Tensor& t) {
    return {t.sizes().vec(), t.scalar_type(), t.device(), t._version()};
  }
};

// One checkpointed call of a segment: what its rerun needs, and the tensors a rerun collected
// until backward takes them. Kept alive by its placeholders, i.e. by the graph.
struct Frame : std::enable_shared_from_this<Frame> {
  Frame(void* data, tchmem_segment_call call, tchmem_segment_drop drop)
      : segment(data, call, drop) {}

  Segment segment;
  tchmem::StoredInput input;  // kept, quantized or offloaded; shares the version counter
  bool input_requires_grad = false;
  int64_t input_version = 0;
  std::unique_ptr<RunState> state;
  // The segment that ran before this one (whose rerun comes next in backward), to prefetch its
  // stored input while this one reruns.
  std::weak_ptr<Frame> previous;

  // Placeholders made in the forward, and what each one stood for if it was packed (libtorch
  // asks for hooks for wrapped numbers too, then drops them unused).
  size_t placeholders = 0;
  std::vector<std::optional<SavedShape>> packed;
  size_t last_packed = 0;
  // While the forward runs, a backward through the segment cannot rerun it.
  bool forward_running = false;

  std::mutex mutex;
  std::vector<at::Tensor> recomputed;
  size_t collectors = 0;  // collectors made by the rerun in progress

  void collect(size_t index, const at::Tensor& tensor);
  at::Tensor unpack(size_t index);
  void recompute();
};

// The last segment whose forward ran on this thread with a stored input (its successor's rerun
// prefetches it).
thread_local std::weak_ptr<Frame> last_stored;

// The frame whose forward (or rerun) is running on this thread, innermost last.
struct Active {
  Frame* frame;
  bool recomputing;
};
thread_local std::vector<Active> active_frames;

// Makes `frame` the active one on this thread until it ends; a forward also marks the frame as
// running (for backwards started from other threads).
struct ActiveGuard {
  ActiveGuard(Frame* frame, bool recomputing) : frame(frame), forward(!recomputing) {
    active_frames.push_back({frame, recomputing});
    if (forward) frame->forward_running = true;
  }
  ~ActiveGuard() {
    active_frames.pop_back();
    if (forward) frame->forward_running = false;
  }
  Frame* frame;
  bool forward;
};

// Saved in the forward in place of a tensor.
struct Placeholder : SavedVariableHooks {
  Placeholder(std::shared_ptr<Frame> frame, size_t index) : frame(std::move(frame)), index(index) {}
  void call_pack_hook(const at::Tensor& tensor) override {
    frame->packed[index] = SavedShape::of(tensor);
    frame->last_packed = index;
  }
  at::Tensor call_unpack_hook() override { return frame->unpack(index); }

  std::shared_ptr<Frame> frame;
  size_t index;
};

// Saved by the rerun: hands the tensor to the frame.
struct Collector : SavedVariableHooks {
  Collector(Frame* frame, size_t index) : frame(frame), index(index) {}
  void call_pack_hook(const at::Tensor& tensor) override { frame->collect(index, tensor); }
  at::Tensor call_unpack_hook() override {
    throw std::runtime_error("tchmem: a tensor saved by a checkpoint rerun was used in backward");
  }

  Frame* frame;
  size_t index;
};

void Frame::collect(size_t index, const at::Tensor& tensor) {
  if (index >= placeholders || !packed[index]) return;
  const SavedShape& was = *packed[index];
  const SavedShape now = SavedShape::of(tensor);
  if (now.version != was.version) {
    throw std::runtime_error(
        "tchmem: a tensor a checkpointed segment saved for backward was modified in place "
        "between its forward pass and backward (a parameter changed by an optimizer step?); "
        "run backward before changing it");
  }
  if (now.sizes != was.sizes || now.dtype != was.dtype || now.device != was.device) {
    throw std::runtime_error(
        "tchmem: a checkpointed segment saved different tensors when run again in backward (it "
        "must be a pure function of its input and parameters: no data-dependent branches)");
  }
  recomputed[index] = tensor.detach();
  if (index == last_packed) throw RecomputeComplete();
}

at::Tensor Frame::unpack(size_t index) {
  if (forward_running) {
    throw std::runtime_error(
        "tchmem: autograd through a checkpointed segment while its forward pass is still "
        "running (a gradient computed inside the segment) is not supported");
  }
  std::lock_guard<std::mutex> lock(mutex);
  // A second backward through the graph (retain_graph) finds the tensor taken: rerun again.
  if (index >= recomputed.size() || !recomputed[index].defined()) recompute();
  if (!recomputed[index].defined()) {
    // Plain exceptions: libtorch's would carry a C++ backtrace into the notebook.
    throw std::runtime_error(
        "tchmem: a checkpointed segment saved different tensors when run again in backward (it "
        "must be a pure function of its input and parameters)");
  }
  at::Tensor out = std::move(recomputed[index]);
  recomputed[index] = at::Tensor();
  return out;
}

void Frame::recompute() {
  if (input.version() != input_version) {
    throw std::runtime_error(
        "tchmem: the input of a checkpointed segment was modified in place (inside the segment "
        "or after it ran); backward needs it unchanged (clone it first)");
  }
  recomputed.assign(placeholders, at::Tensor());
  collectors = 0;
  RunStateGuard state_guard(*state);
  at::AutoGradMode grad(true);
  use_this_copys_engine();
  ActiveGuard active(this, true);
  at::Tensor rerun_input = input.restore().detach();
  rerun_input.requires_grad_(input_requires_grad);
  // Backward reruns segments last to first: bring the one before back while this one runs.
  if (auto before = previous.lock()) before->input.prefetch();
  try {
    segment.run(rerun_input);
  } catch (const std::exception&) {
    // The rerun was stopped once the last saved tensor was in (the error comes back through
    // the Rust closure as text); anything else is a real failure.
    if (placeholders == 0 || !recomputed[last_packed].defined()) throw;
  }
}

// Asks the active frame for hooks, and hands every backward to libtorch's own engine: an
// engine's worker threads are started once per process, whichever engine came first, so this
// one must never run a graph itself (it would find no threads for CUDA work).
struct CheckpointEngine : torch::autograd::Engine {
  CheckpointEngine() = default;
  torch::autograd::variable_list execute(const torch::autograd::edge_list& roots,
                                         const torch::autograd::variable_list& inputs,
                                         bool keep_graph, bool create_graph, bool accumulate_grad,
                                         const torch::autograd::edge_list& outputs) override {
    return Engine::get_base_engine().execute(roots, inputs, keep_graph, create_graph,
                                             accumulate_grad, outputs);
  }
  c10::intrusive_ptr<at::ivalue::Future> execute_with_graph_task(
      const std::shared_ptr<torch::autograd::GraphTask>& graph_task,
      std::shared_ptr<torch::autograd::Node> graph_root,
      torch::autograd::InputBuffer&& input_buffer) override {
    return Engine::get_base_engine().execute_with_graph_task(graph_task, std::move(graph_root),
                                                             std::move(input_buffer));
  }
  std::unique_ptr<SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (active_frames.empty()) return nullptr;
    const Active& active = active_frames.back();
    Frame* frame = active.frame;
    if (active.recomputing) return std::make_unique<Collector>(frame, frame->collectors++);
    frame->packed.emplace_back();
    return std::make_unique<Placeholder>(frame->shared_from_this(), frame->placeholders++);
  }
};

torch::autograd::Engine& checkpoint_engine() {
  // Never destroyed: worker threads may outlive static destruction.
  static auto* engine = new CheckpointEngine();
  return *engine;
}

// Makes this copy's engine libtorch's default. In the kernel every cell links its own copy of
// this file, with its own `active_frames`, so the copy running a segment's forward or rerun
// installs its engine for it (an atomic store) rather than once: otherwise a model built in one
// cell and trained in another would consult the wrong copy's frames.
void use_this_copys_engine() { torch::autograd::set_default_engine_stub(&checkpoint_engine); }

}  // namespace

extern "C" {

// Runs `call` on `input` as one checkpointed segment and stores the output in `*out` (a new
// tensor owned by the caller). Takes ownership of `data` (freed with `drop`, also on error).
// Without grad mode the segment simply runs. Returns 0, or -1 with a message in `err`.
// `offload` and `compression` (tchmem::Compression's codes) say where the segment's input waits
// for the rerun.
int tchmem_checkpoint(void* data, tchmem_segment_call call, tchmem_segment_drop drop,
                      const at::Tensor* input, int offload, int compression, at::Tensor** out,
                      char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        use_this_copys_engine();
        auto frame = std::make_shared<Frame>(data, call, drop);
        if (!at::GradMode::is_enabled()) {
          *out = new at::Tensor(frame->segment.run(*input));
          return;
        }
        frame->input_requires_grad = input->requires_grad();
        frame->input_version = input->_version();
        // Dropout and other random ops must draw the same numbers when rerun.
        frame->state = std::make_unique<RunState>(RunState::current(input->device()));
        at::Tensor result;
        {
          ActiveGuard active(frame.get(), false);
          result = frame->segment.run(*input);
        }
        const tchmem::Keeping keeping{offload != 0,
                                      static_cast<tchmem::Compression>(compression)};
        // Stored once the segment has run: the next segment starts as the copy goes. The
        // output is handed over only after (a failed store must not leak it).
        frame->input.store(*input, keeping);
        *out = new at::Tensor(std::move(result));
        if (!keeping.plain()) {
          frame->previous = last_stored;
          last_stored = frame;
        }
      },
      err, err_len);
}

}  // extern "C"
