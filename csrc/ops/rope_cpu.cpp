// CPU implementation of RoPE from ATen ops: the same semantics as the kernel (math in fp32, or fp64 for fp64
// inputs), so code and tests run without a GPU. Not tuned for speed.
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <torch/library.h>

#include "ops/rope.h"

namespace fused {

at::Tensor rope_cpu(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o, bool backward) {
  RopeGeometry g = check_rope_inputs(t, freqs, o, backward ? "grad_output" : "t");
  check_rope_values(g, o);  // free on the CPU
  const auto compute = t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // Rows in memory order of a contiguous tensor: sbhd (s, b), bshd (b, s), thd (t), as rope_positions_cpu.
  at::Tensor x = t.reshape({g.rows, g.H, g.D}).to(compute);
  at::Tensor pos = rope_positions_cpu(g, o);
  at::Tensor f = freqs.reshape({g.s_max, g.D2}).index_select(0, pos).to(compute).unsqueeze(1);  // [rows, 1, d2]

  const int64_t half = g.D2 / 2;
  at::Tensor rot = x.narrow(2, 0, g.D2);
  at::Tensor xa, xb, fa, fb;
  if (o.interleaved) {
    xa = rot.slice(2, 0, g.D2, 2), xb = rot.slice(2, 1, g.D2, 2);
    fa = f.slice(2, 0, g.D2, 2), fb = f.slice(2, 1, g.D2, 2);
  } else {
    xa = rot.narrow(2, 0, half), xb = rot.narrow(2, half, half);
    fa = f.narrow(2, 0, half), fb = f.narrow(2, half, half);
  }
  at::Tensor sa = fa.sin(), sb = fb.sin();
  if (backward) std::tie(sa, sb) = std::make_tuple(-sb, -sa);  // the transpose of the 2x2 rotation
  at::Tensor oa = xa * fa.cos() - xb * sa;
  at::Tensor ob = xb * fb.cos() + xa * sb;
  at::Tensor rotated = o.interleaved ? at::stack({oa, ob}, -1).flatten(-2) : at::cat({oa, ob}, -1);
  at::Tensor out = g.D2 < g.D ? at::cat({rotated, x.narrow(2, g.D2, g.D - g.D2)}, -1) : rotated;
  return out.to(t.scalar_type()).reshape(t.sizes()).contiguous();
}

}  // namespace fused

// The ops' kernels on this backend, registered here (the schemas: csrc/torch_bindings.cpp).
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
