// CPU implementation of rms_norm from ATen ops, written from the contract (csrc/torch_bindings.cpp), not from the
// kernel: float32 math for float32 / float16 / bfloat16 (float64 for float64), rounded once to x's dtype.
#include <ATen/TensorOperators.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/rsqrt.h>
#include <torch/library.h>

#include "ops/rms_norm.h"

namespace fused {

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_inputs(x, weight, eps);
  const auto compute = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor xf = x.to(compute);
  const at::Tensor rstd = at::rsqrt(at::mean(xf * xf, {-1}, /*keepdim=*/true) + eps);
  return (xf * rstd * weight.to(compute)).to(x.scalar_type()).contiguous();
}

}  // namespace fused

// The op's kernel on this backend, registered here (the schema: csrc/torch_bindings.cpp).
TORCH_LIBRARY_IMPL(fused, CPU, m) { m.impl("rms_norm", fused::rms_norm_cpu); }
