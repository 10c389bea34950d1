// See ../README.md: declarations only, for ProcessGroupGloo.hpp.
#pragma once
#include <chrono>

namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport

// Named by an inline method of the header (ProcessGroupGloo::setTimeout), never called here.
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
}  // namespace gloo
