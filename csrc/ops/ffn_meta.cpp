// Meta (shape) kernels of the ffn ops: torch.compile, torch.export and fake tensors trace through them.
#include <torch/library.h>

#include "ops/ffn.h"

namespace {
using at::Tensor;

Tensor fwd(const Tensor& x, FUSED_FFN_ARGS) {
  (void)allow_tf32;
  fused::check_ffn_inputs(x, w1, w3, w2, mask, u1, u3, u2);
  return at::empty(x.sizes(), x.options());
}

std::vector<Tensor> bwd(const Tensor& grad_out, const Tensor& x, FUSED_FFN_ARGS) {
  (void)allow_tf32;
  const auto g = fused::check_ffn_backward_inputs(grad_out, x, w1, w3, w2, mask, u1, u3, u2);
  const auto opt = x.options();
  std::vector<Tensor> out = {at::empty(x.sizes(), opt)};
  for (int e = 0; e < (g.dual ? 2 : 1); ++e)
    out.insert(out.end(), {at::empty({g.I, g.H}, opt), at::empty({g.I, g.H}, opt), at::empty({g.H, g.I}, opt)});
  return out;
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Meta, m) {
  m.impl("ffn", fwd);
  m.impl("ffn_backward", bwd);
}
