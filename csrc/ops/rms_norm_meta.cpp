// What rms_norm accepts and returns, in one place: the input checks (check_rms_norm_inputs), which the CPU, CUDA and
// Meta kernels all run first, and the Meta kernel (shapes only: torch.compile, torch.export with dynamic shapes).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "ops/rms_norm.h"

namespace fused {

void check_rms_norm_inputs(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "rms_norm: x must have at least one dimension (the normalized one), got a scalar");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.sym_size(0) == x.sym_size(-1), "rms_norm: weight must be [",
                    x.sym_size(-1), "] (x's last dimension), got ", weight.sym_sizes());
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "rms_norm: weight must have x's dtype ", x.scalar_type(),
                    ", got ", weight.scalar_type());
  TORCH_CHECK_VALUE(x.is_floating_point(), "rms_norm: x must be a floating-point tensor, got ", x.scalar_type());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "rms_norm: eps must be finite and >= 0, got ", eps);
  TORCH_CHECK(weight.device() == x.device(), "rms_norm: weight must be on x's device ", x.device(), ", got ",
              weight.device());
}

}  // namespace fused

namespace {
at::Tensor meta(const at::Tensor& x, const at::Tensor& weight, double eps) {
  fused::check_rms_norm_inputs(x, weight, eps);
  return at::empty_symint(x.sym_sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Meta, m) { m.impl("rms_norm", meta); }
