// Autograd of rms_norm, in C++ so that it holds from Python, TorchScript and libtorch alike. Where a gradient is asked
// for, the op is computed by torch's own differentiable at::rms_norm (the same math: float32, rounded once), whose
// backward torch has; otherwise (inference, a decode step) it goes on to this library's CPU / CUDA kernel.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/rms_norm.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/rms_norm.h"

namespace {

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) {
    fused::check_rms_norm_inputs(x, weight, eps);
    return at::rms_norm_symint(x, {x.sym_size(-1)}, weight, eps);
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fused::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(x, weight, eps);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, Autograd, m) { m.impl("rms_norm", rms_norm_autograd); }
