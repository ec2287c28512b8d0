// Meta (shape) kernels of the ffn ops: torch.compile, torch.export and fake tensors trace through them. Sizes stay
// symbolic (sym_sizes, *_symint): one trace serves every batch and sequence length.
#include <torch/library.h>

#include "ops/ffn.h"
#include "ops/routed_gemm.h"

namespace {
using at::Tensor;

Tensor fwd(const Tensor& x, FUSED_FFN_ARGS, const std::optional<Tensor>& routing, bool recompute) {
  (void)allow_tf32;
  (void)recompute;
  fused::check_ffn_inputs_symint(x, w1, w3, w2, mask, u1, u3, u2, routing);
  return at::empty_symint(x.sym_sizes(), x.options());
}

std::tuple<Tensor, Tensor> fwd_saving(const Tensor& x, FUSED_FFN_ARGS, const std::optional<Tensor>& routing) {
  (void)allow_tf32;
  const auto g = fused::check_ffn_inputs_symint(x, w1, w3, w2, mask, u1, u3, u2, routing);
  return {at::empty_symint(x.sym_sizes(), x.options()),
          at::empty_symint(fused::with_last_symint(x, g.I * 2), x.options())};
}

fused::FfnGrads bwd(const Tensor& grad_out, const Tensor& x, FUSED_FFN_ARGS, fused::FfnOutputMask output_mask,
                    const std::optional<Tensor>& routing, const std::optional<Tensor>& gate_up) {
  (void)allow_tf32;
  const auto g = fused::check_ffn_backward_inputs_symint(grad_out, x, w1, w3, w2, mask, u1, u3, u2, routing);
  if (fused::present(gate_up)) fused::check_gate_up_symint(*gate_up, x, g.I, "ffn_backward");
  const auto opt = x.options();
  const auto out = [&](int i, c10::SymIntArrayRef size) {
    return output_mask[i] && (i < 4 || (g.dual && !g.stacked)) ? at::empty_symint(size, opt) : Tensor();
  };
  // the weights' own shapes: [I, H] / [H, I], or stacked [2, ...]
  return {out(0, x.sym_sizes()), out(1, w1.sym_sizes()), out(2, w3.sym_sizes()), out(3, w2.sym_sizes()),
          out(4, w1.sym_sizes()), out(5, w3.sym_sizes()), out(6, w2.sym_sizes())};
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Meta, m) {
  m.impl("ffn", fwd);
  m.impl("ffn_forward", fwd_saving);
  m.impl("ffn_backward", bwd);
}
