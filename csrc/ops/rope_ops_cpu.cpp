// CPU kernels of the rope ops (the ATen reference in rope_cpu.cpp).
#include <torch/library.h>

#include "ops/rope.h"

namespace {
using at::Tensor;

Tensor fwd(const Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return fused::rope_cpu(t, freqs, FUSED_ROPE_OPTS, false);
}
Tensor bwd(const Tensor& g, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return fused::rope_cpu(g, freqs, FUSED_ROPE_OPTS, true);
}
void fwd_(Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) {
  t.copy_(fused::rope_cpu(t, freqs, FUSED_ROPE_OPTS, false));
}
std::tuple<Tensor, Tensor> qk(const Tensor& q, const Tensor& k, const Tensor& freqs, bool backward,
                              const fused::RopeOptions& o) {
  fused::check_rope_qk_inputs(q, k, freqs, o);
  return {fused::rope_cpu(q, freqs, o, backward), fused::rope_cpu(k, freqs, o, backward)};
}
std::tuple<Tensor, Tensor> fwd_qk(const Tensor& q, const Tensor& k, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return qk(q, k, freqs, false, FUSED_ROPE_OPTS);
}
std::tuple<Tensor, Tensor> bwd_qk(const Tensor& q, const Tensor& k, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return qk(q, k, freqs, true, FUSED_ROPE_OPTS);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, CPU, m) {
  m.impl("rope_fwd", fwd);
  m.impl("rope_bwd", bwd);
  m.impl("rope_fwd_", fwd_);
  m.impl("rope_fwd_qk", fwd_qk);
  m.impl("rope_bwd_qk", bwd_qk);
}
