// Meta (shape) kernels of the linear_dual ops: torch.compile, torch.export and fake tensors trace through them. Sizes
// stay symbolic (sym_sizes, *_symint): one trace serves every batch and sequence length.
#include <torch/library.h>

#include "ops/linear_dual.h"
#include "ops/routed_gemm.h"

namespace {
using at::Tensor;

Tensor fwd(const Tensor& x, const Tensor& mask, const Tensor& weight_v, const Tensor& weight_t,
           const std::optional<Tensor>& bias_v, const std::optional<Tensor>& bias_t, bool /*allow_tf32*/,
           const std::optional<Tensor>& routing) {
  const auto g = fused::check_linear_dual_inputs_symint(x, mask, weight_v, weight_t, bias_v, bias_t);
  fused::check_routing(routing, g.M, x, "linear_dual", /*forward_routing=*/true);
  return at::empty_symint(fused::with_last_symint(x, g.N), x.options());
}

std::tuple<Tensor, Tensor> fwd_routing(const Tensor& x, const Tensor& mask, const Tensor& weight_v,
                                      const Tensor& weight_t, const std::optional<Tensor>& bias_v,
                                      const std::optional<Tensor>& bias_t, bool /*allow_tf32*/) {
  const auto g = fused::check_linear_dual_inputs_symint(x, mask, weight_v, weight_t, bias_v, bias_t);
  return {at::empty_symint(fused::with_last_symint(x, g.N), x.options()),
          at::empty_symint({fused::routed::routing_buffer_size(g.M)}, x.options().dtype(at::kInt))};
}

fused::LinearDualGrads bwd(const Tensor& grad_out, const Tensor& x, const Tensor& mask, const Tensor& weight_v,
                           const Tensor& weight_t, bool /*allow_tf32*/, fused::LinearDualOutputMask output_mask,
                           const std::optional<Tensor>& routing) {
  const auto g = fused::check_linear_dual_backward_inputs_symint(grad_out, x, mask, weight_v, weight_t);
  fused::check_routing(routing, g.M, x, "linear_dual", /*forward_routing=*/true);
  const auto opt = x.options();
  const auto out = [&](int i, c10::SymIntArrayRef size) {
    return output_mask[i] ? at::empty_symint(size, opt) : Tensor();
  };
  return {out(0, x.sym_sizes()), out(1, {g.N, g.K}), out(2, {g.N, g.K}), out(3, {g.N}), out(4, {g.N})};
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Meta, m) {
  m.impl("linear_dual", fwd);
  m.impl("linear_dual_forward", fwd_routing);
  m.impl("linear_dual_backward", bwd);
}
