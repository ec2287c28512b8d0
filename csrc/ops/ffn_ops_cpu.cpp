// CPU kernels of the ffn ops (the ATen reference in ffn_cpu.cpp).
#include <torch/library.h>

#include "ops/ffn.h"

TORCH_LIBRARY_IMPL(fused, CPU, m) {
  m.impl("ffn", fused::ffn_cpu);
  m.impl("ffn_forward", fused::ffn_forward_cpu);
  m.impl("ffn_backward", fused::ffn_backward_cpu);
}
