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
  std::array<Tensor, 7> out;
  if (output_mask[fused::kGradX]) out[fused::kGradX] = at::empty_symint(x.sym_sizes(), opt);
  const Tensor* weight[3] = {&w1, &w3, &w2};  // FfnProj order; each gradient has its weight's shape (u's: the same)
  for (int expert = 0; expert < (g.dual ? 2 : 1); ++expert)
    for (int proj : {fused::kGate, fused::kUp, fused::kDown}) {
      const int slot = fused::ffn_grad_slot(g, expert, proj);
      if (output_mask[slot]) out[slot] = at::empty_symint(weight[proj]->sym_sizes(), opt);
    }
  return {out[0], out[1], out[2], out[3], out[4], out[5], out[6]};
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Meta, m) {
  m.impl("ffn", fwd);
  m.impl("ffn_forward", fwd_saving);
  m.impl("ffn_backward", bwd);
}
