// Meta (shape) kernels of the rope ops: torch.compile, torch.export and fake tensors trace through them. Sizes stay
// symbolic (sym_sizes, check_rope_inputs_symint): one trace serves every batch, sequence length and token count.
#include <torch/library.h>

#include "ops/rope.h"

namespace {
using at::Tensor;

Tensor like(const Tensor& t) {
  return at::empty_symint(t.sym_sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
}

Tensor fwd(const Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) {
  fused::check_rope_inputs_symint(t, freqs, FUSED_ROPE_OPTS, "t");
  return like(t);
}
Tensor bwd(const Tensor& g, const Tensor& freqs, FUSED_ROPE_ARGS) {
  fused::check_rope_inputs_symint(g, freqs, FUSED_ROPE_OPTS, "grad_output");
  return like(g);
}
void fwd_(Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) {
  fused::check_rope_inputs_symint(t, freqs, FUSED_ROPE_OPTS, "t");
}
std::tuple<Tensor, Tensor> qk(const Tensor& q, const Tensor& k, const Tensor& freqs, FUSED_ROPE_ARGS) {
  fused::check_rope_qk_inputs_symint(q, k, freqs, FUSED_ROPE_OPTS);
  return {like(q), like(k)};
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Meta, m) {
  m.impl("rope_fwd", fwd);
  m.impl("rope_bwd", bwd);
  m.impl("rope_fwd_", fwd_);
  m.impl("rope_fwd_qk", qk);
  m.impl("rope_bwd_qk", qk);
}
