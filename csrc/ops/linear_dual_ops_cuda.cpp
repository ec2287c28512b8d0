// CUDA kernels of the linear_dual ops (linear_dual_cuda.cpp launches the AOT-compiled routed GEMM kernels).
#include <torch/library.h>

#include "ops/linear_dual.h"

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("linear_dual", fused::linear_dual_cuda);
  m.impl("linear_dual_forward", fused::linear_dual_forward_cuda);
  m.impl("linear_dual_backward", fused::linear_dual_backward_cuda);
}
