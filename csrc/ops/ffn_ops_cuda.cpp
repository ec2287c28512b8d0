// CUDA kernels of the ffn ops (ffn_cuda.cpp launches the AOT-compiled routed GEMM kernels).
#include <torch/library.h>

#include "ops/ffn.h"

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("ffn", fused::ffn_cuda);
  m.impl("ffn_forward", fused::ffn_forward_cuda);
  m.impl("ffn_backward", fused::ffn_backward_cuda);
}
