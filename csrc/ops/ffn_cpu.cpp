// CPU implementation of ffn from ATen ops: the reference semantics of the op. Every token goes only through its own
// expert (rows selected by the mask), math in fp32 (fp64 for fp64 inputs) without rounding intermediates, results
// in x's dtype. allow_tf32 does not apply on the CPU. Not tuned for speed.
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "ops/ffn.h"
#include "ops/routed_gemm.h"

namespace fused {
namespace {

at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

struct Expert {
  at::Tensor rows;  // int64 token indices; undefined = every row (single expert)
  at::Tensor w1, w3, w2;
};

// Expert 1 (vision, w*, or w*[1] stacked) then expert 0 (text, u*, or w*[0]) for the dual expert; just (w*) for the
// single expert.
std::vector<Expert> experts(const FfnGeometry& g, const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2,
                            const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& u1,
                            const std::optional<at::Tensor>& u3, const std::optional<at::Tensor>& u2,
                            at::ScalarType ct) {
  if (!g.dual) return {{at::Tensor(), w1.to(ct), w3.to(ct), w2.to(ct)}};
  const at::Tensor m = mask->reshape({g.M});
  if (g.stacked)
    return {{m.nonzero().flatten(), w1[1].to(ct), w3[1].to(ct), w2[1].to(ct)},
            {m.logical_not().nonzero().flatten(), w1[0].to(ct), w3[0].to(ct), w2[0].to(ct)}};
  return {{m.nonzero().flatten(), w1.to(ct), w3.to(ct), w2.to(ct)},
          {m.logical_not().nonzero().flatten(), u1->to(ct), u3->to(ct), u2->to(ct)}};
}

at::Tensor rows_of(const at::Tensor& t, const at::Tensor& rows) { return rows.defined() ? t.index_select(0, rows) : t; }
int64_t count(const Expert& e, int64_t M) { return e.rows.defined() ? e.rows.numel() : M; }

// Token rows `rows` (every row when undefined) of dst <- src.
void put_rows(at::Tensor& dst, const at::Tensor& rows, const at::Tensor& src) {
  if (rows.defined()) dst.index_copy_(0, rows, src);
  else dst.copy_(src);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ffn_forward_cpu(const at::Tensor& x, FUSED_FFN_ARGS,
                                                   const std::optional<at::Tensor>& routing,
                                                   const std::optional<at::Tensor>& residual) {
  const FfnGeometry g = check_ffn_inputs(x, w1, w3, w2, mask, u1, u3, u2, routing);
  check_residual(residual, x);
  if (present(routing)) check_routing_of_mask(*routing, *mask, "ffn");  // the CPU routes from the mask
  const auto ct = compute_type(x.scalar_type());
  const at::Tensor xr = x.reshape({g.M, g.H}).to(ct);
  at::Tensor out = at::zeros({g.M, g.H}, x.options().dtype(ct));
  at::Tensor gate_up = at::zeros({g.M, 2 * g.I}, x.options().dtype(ct));
  for (const Expert& e : experts(g, w1, w3, w2, mask, u1, u3, u2, ct)) {
    if (count(e, g.M) == 0) continue;
    const at::Tensor xe = rows_of(xr, e.rows);
    const at::Tensor gate = xe.matmul(e.w1.t()), up = xe.matmul(e.w3.t());
    put_rows(out, e.rows, (at::silu(gate) * up).matmul(e.w2.t()));
    put_rows(gate_up, e.rows, at::cat({gate, up}, 1));
  }
  if (present(residual)) out.add_(residual->reshape({g.M, g.H}).to(ct));  // before the one rounding, as on CUDA
  return {out.to(x.scalar_type()).reshape(x.sizes()), gate_up.to(x.scalar_type()).reshape(with_last(x, 2 * g.I))};
}

at::Tensor ffn_cpu(const at::Tensor& x, FUSED_FFN_ARGS, const std::optional<at::Tensor>& routing, bool recompute,
                   const std::optional<at::Tensor>& residual) {
  (void)recompute;
  return std::get<0>(ffn_forward_cpu(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing, residual));
}

// gate_up (ffn_forward's): gate and up are read from it, as the CUDA backward does, instead of recomputed.
FfnGrads ffn_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, FUSED_FFN_ARGS, FfnOutputMask output_mask,
                          const std::optional<at::Tensor>& routing, const std::optional<at::Tensor>& gate_up) {
  const FfnGeometry g = check_ffn_backward_inputs(grad_out, x, w1, w3, w2, mask, u1, u3, u2, routing);
  if (present(routing)) check_routing_of_mask(*routing, *mask, "ffn");
  if (present(gate_up)) check_gate_up(*gate_up, x, g.I, "ffn_backward");
  const auto dt = x.scalar_type();
  const auto ct = compute_type(dt);
  const auto copt = x.options().dtype(ct);
  const at::Tensor xr = x.reshape({g.M, g.H}).to(ct);
  const at::Tensor dy = grad_out.reshape({g.M, g.H}).to(ct);
  const at::Tensor gu = present(gate_up) ? gate_up->reshape({g.M, 2 * g.I}).to(ct) : at::Tensor();
  const bool want_gx = output_mask[kGradX];
  at::Tensor gx = want_gx ? at::zeros({g.M, g.H}, copt) : at::Tensor();
  at::Tensor dw[2][3];  // [expert (0 text, 1 vision)][FfnProj]
  const std::vector<Expert> es = experts(g, w1, w3, w2, mask, u1, u3, u2, ct);
  for (size_t i = 0; i < es.size(); ++i) {
    const Expert& e = es[i];
    const int expert = g.dual && i == 0 ? 1 : 0;  // experts() lists the vision expert first
    at::Tensor* grads = dw[expert];
    const auto want = [&](int proj) { return output_mask[ffn_grad_slot(g, expert, proj)]; };
    if (count(e, g.M) == 0) {
      if (want(kGate)) grads[kGate] = at::zeros({g.I, g.H}, copt);
      if (want(kUp)) grads[kUp] = at::zeros({g.I, g.H}, copt);
      if (want(kDown)) grads[kDown] = at::zeros({g.H, g.I}, copt);
      continue;
    }
    if (!want_gx && !want(kGate) && !want(kUp) && !want(kDown)) continue;
    const at::Tensor xe = rows_of(xr, e.rows), dye = rows_of(dy, e.rows);
    const at::Tensor gue = gu.defined() ? rows_of(gu, e.rows) : at::Tensor();
    const at::Tensor gate = gue.defined() ? gue.narrow(1, 0, g.I) : xe.matmul(e.w1.t());
    const at::Tensor up = gue.defined() ? gue.narrow(1, g.I, g.I) : xe.matmul(e.w3.t());
    const at::Tensor s = at::sigmoid(gate);
    const at::Tensor act = gate * s;                         // silu(gate)
    const at::Tensor h = act * up;
    const at::Tensor dh = dye.matmul(e.w2);                  // [n, I]
    const at::Tensor dup = dh * act;
    const at::Tensor dgate = dh * up * (s + act * (1 - s));  // silu'(g) = s (1 + g (1 - s))
    if (want_gx) put_rows(gx, e.rows, dgate.matmul(e.w1) + dup.matmul(e.w3));
    if (want(kGate)) grads[kGate] = dgate.t().matmul(xe);
    if (want(kUp)) grads[kUp] = dup.t().matmul(xe);
    if (want(kDown)) grads[kDown] = dye.t().matmul(h);
  }
  // Into the op's slots, in x's dtype: one per projection and expert, or both experts stacked [text, vision].
  FfnGradArray out;
  if (want_gx) out[kGradX] = gx.to(dt).reshape(x.sizes());
  for (int expert = 0; expert < (g.dual ? 2 : 1); ++expert)
    for (int proj : {kGate, kUp, kDown}) {
      const at::Tensor& t = dw[expert][proj];
      if (!t.defined()) continue;
      out[ffn_grad_slot(g, expert, proj)] = g.stacked ? at::stack({dw[0][proj], dw[1][proj]}).to(dt) : t.to(dt);
    }
  return to_tuple(out);
}

}  // namespace fused

TORCH_LIBRARY_IMPL(fused, CPU, m) {
  m.impl("ffn", fused::ffn_cpu);
  m.impl("ffn_forward", fused::ffn_forward_cpu);
  m.impl("ffn_backward", fused::ffn_backward_cpu);
}
