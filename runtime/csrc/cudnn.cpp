// cuDNN's settings that tch can set but not read.
#include <ATen/Context.h>

extern "C" {

// Whether cuDNN's benchmark mode is on (`tch::Cuda::cudnn_set_benchmark`): then the first
// convolution at each shape new to the process times cuDNN's algorithms.
// A plain getter of a flag: it cannot throw.
int tchmem_cudnn_benchmark() { return at::globalContext().benchmarkCuDNN() ? 1 : 0; }

}  // extern "C"
