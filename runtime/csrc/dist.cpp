// A process group of libtorch's c10d (Gloo over TCP on this host, rendezvous through a file), for
// data parallel training across processes. Made once per process; every cell's copy of the shim
// uses it through its address (kept in the runtime's process-wide state). Only virtual calls
// through c10d::Backend, and libtorch's exported constructor: gloo_declarations/ (see its README)
// stands in for Gloo's headers, so nothing inline that touches Gloo may be called here.
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "error.h"

namespace {

using Group = c10::intrusive_ptr<c10d::Backend>;

Group& group_at(void* address) { return *static_cast<Group*>(address); }

// Gloo takes one tensor per collective (a list is one tensor per device of a process), and
// reads and writes its elements from its data pointer on: it must be contiguous (the Rust side
// passes a contiguous copy otherwise).
std::vector<at::Tensor> one(at::Tensor* tensor) {
  TORCH_CHECK(tensor->is_contiguous(), "a collective needs a contiguous tensor");
  return {*tensor};
}

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case 1:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case 2:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    default:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
  }
}

}  // namespace

extern "C" {

// A Gloo process group of `size` processes, this one `rank`, meeting through the file at
// `store_path` (the same path in every process, absent or empty before the first one starts).
// Every collective fails after `timeout_ms` rather than wait for a rank that is gone.
int tchmem_dist_new_gloo(const char* store_path, int rank, int size, int64_t timeout_ms,
                         void** out, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        const auto timeout = std::chrono::milliseconds(timeout_ms);
        auto store = c10::make_intrusive<c10d::FileStore>(store_path, size);
        store->setTimeout(timeout);
        auto options = c10d::ProcessGroupGloo::Options::create(timeout);
        // Every rank is on this host: loopback, whatever the host's name resolves to (an
        // offline GPU server's may not resolve at all).
        options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1", false));
        Group group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
        *out = new Group(std::move(group));
      },
      err, err_len);
}

// Ends the process group made by tchmem_dist_new_gloo.
void tchmem_dist_free(void* group) { delete static_cast<Group*>(group); }

// Reduces `tensor` across the ranks in place (op 0: sum, 1: max, 2: min).
int tchmem_dist_all_reduce(void* group, at::Tensor* tensor, int op, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto tensors = one(tensor);
        c10d::AllreduceOptions options;
        options.reduceOp = reduce_op(op);
        group_at(group)->allreduce(tensors, options)->wait();
      },
      err, err_len);
}

// Copies rank `root`'s `tensor` into every rank's.
int tchmem_dist_broadcast(void* group, at::Tensor* tensor, int root, char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto tensors = one(tensor);
        c10d::BroadcastOptions options;
        options.rootRank = root;
        group_at(group)->broadcast(tensors, options)->wait();
      },
      err, err_len);
}

// Every rank's `input` side by side, in rank order, into `output` (world size × its elements).
int tchmem_dist_all_gather(void* group, at::Tensor* output, at::Tensor* input, char* err,
                           size_t err_len) {
  return tchmem::guarded(
      [&] {
        TORCH_CHECK(output->is_contiguous() && input->is_contiguous(),
                    "an all-gather needs contiguous tensors");
        group_at(group)->_allgather_base(*output, *input)->wait();
      },
      err, err_len);
}

// `input` (world size × `output`'s elements) reduced across the ranks; this rank's share of the
// result (its rank's slice) into `output`.
int tchmem_dist_reduce_scatter(void* group, at::Tensor* output, at::Tensor* input, int op,
                               char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        TORCH_CHECK(output->is_contiguous() && input->is_contiguous(),
                    "a reduce-scatter needs contiguous tensors");
        c10d::ReduceScatterOptions options;
        options.reduceOp = reduce_op(op);
        group_at(group)->_reduce_scatter_base(*output, *input, options)->wait();
      },
      err, err_len);
}

// Returns once every rank has called it.
int tchmem_dist_barrier(void* group, char* err, size_t err_len) {
  return tchmem::guarded([&] { group_at(group)->barrier()->wait(); }, err, err_len);
}

}  // extern "C"
