// CPU kernels of the linear_dual ops (the ATen reference in linear_dual_cpu.cpp).
#include <torch/library.h>

#include "ops/linear_dual.h"

TORCH_LIBRARY_IMPL(fused, CPU, m) {
  m.impl("linear_dual", fused::linear_dual_cpu);
  m.impl("linear_dual_forward", fused::linear_dual_forward_cpu);
  m.impl("linear_dual_backward", fused::linear_dual_backward_cpu);
}
