// How the shim reports a C++ exception to Rust: its message, NUL-terminated, in a caller's
// buffer (libtorch's own errors without their C++ backtrace, which says nothing to a notebook
// user). Nothing may unwind into Rust.
#pragma once

#include <c10/util/Exception.h>

#include <cstring>
#include <exception>

namespace tchmem {

inline void write_error(const char* what, char* err, size_t err_len) {
  if (err == nullptr || err_len == 0) return;
  std::strncpy(err, what, err_len - 1);
  err[err_len - 1] = '\0';
}

// Runs `body`; returns 0, or -1 with the exception's message in `err`.
template <typename F>
int guarded(F&& body, char* err, size_t err_len) {
  try {
    body();
    return 0;
  } catch (const c10::Error& e) {
    write_error(e.what_without_backtrace(), err, err_len);
  } catch (const std::exception& e) {
    write_error(e.what(), err, err_len);
  } catch (...) {
    write_error("unknown C++ exception", err, err_len);
  }
  return -1;
}

}  // namespace tchmem
