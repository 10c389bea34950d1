// The C++ stack of the calling thread as libtorch's allocation history records and symbolizes it
// (torch::unwind, the same unwinder and symbolizer the CUDA allocator's `stacks="all"` uses), so
// that the mapping of a cell's frames back to its lines can be checked without a GPU.
#include <torch/csrc/profiler/unwind/unwind.h>

#include <cstring>
#include <string>

#include "error.h"

extern "C" {

// Hands `sink` one "function\tfile\tline" text per frame, innermost first, symbolized in
// `mode` (0 fast, 1 addr2line, 2 dladdr).
int tchmem_stack_frames(int mode, void (*sink)(void* context, const char* frame), void* context,
                        char* err, size_t err_len) {
  return tchmem::guarded(
      [&] {
        auto modes = {torch::unwind::Mode::fast, torch::unwind::Mode::addr2line,
                      torch::unwind::Mode::dladdr};
        auto chosen = *(modes.begin() + (mode >= 0 && mode < 3 ? mode : 0));
        auto frames = torch::unwind::symbolize(torch::unwind::unwind(), chosen);
        for (const auto& frame : frames) {
          auto text = frame.funcname + "\t" + frame.filename + "\t" + std::to_string(frame.lineno);
          sink(context, text.c_str());
        }
      },
      err, err_len);
}

}  // extern "C"
