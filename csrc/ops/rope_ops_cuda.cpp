// CUDA kernels of the rope ops (rope_cuda.cpp launches the AOT-compiled Triton kernel).
#include <torch/library.h>

#include "ops/rope.h"

namespace {
using at::Tensor;

Tensor fwd(const Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return fused::rope_cuda(t, freqs, FUSED_ROPE_OPTS, false);
}
Tensor bwd(const Tensor& g, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return fused::rope_cuda(g, freqs, FUSED_ROPE_OPTS, true);
}
void fwd_(Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) { fused::rope_inplace_cuda(t, freqs, FUSED_ROPE_OPTS); }
std::tuple<Tensor, Tensor> fwd_qk(const Tensor& q, const Tensor& k, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return fused::rope_qk_cuda(q, k, freqs, FUSED_ROPE_OPTS, false);
}
std::tuple<Tensor, Tensor> bwd_qk(const Tensor& q, const Tensor& k, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return fused::rope_qk_cuda(q, k, freqs, FUSED_ROPE_OPTS, true);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("rope_fwd", fwd);
  m.impl("rope_bwd", bwd);
  m.impl("rope_fwd_", fwd_);
  m.impl("rope_fwd_qk", fwd_qk);
  m.impl("rope_bwd_qk", bwd_qk);
}
