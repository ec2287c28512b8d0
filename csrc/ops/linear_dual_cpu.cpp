// CPU implementation of linear_dual from ATen ops: the reference semantics of the op. Every token goes only
// through its own expert (rows selected by the mask), math in fp32 (fp64 for fp64 inputs), results in x's dtype.
// allow_tf32 does not apply on the CPU. Not tuned for speed. linear_dual_forward's routing comes from routing_cpu, the
// reference of the CUDA routing (csrc/ops/route.cpp).
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "ops/linear_dual.h"
#include "ops/routed_gemm.h"

namespace fused {
namespace {

at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

struct Expert {
  at::Tensor rows;  // int64 indices of the tokens routed to this expert
  at::Tensor weight;
};

}  // namespace

at::Tensor linear_dual_cpu(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                           const OptTensor& weight_t, const std::optional<at::Tensor>& bias_v,
                           const std::optional<at::Tensor>& bias_t, bool /*allow_tf32*/,
                           const std::optional<at::Tensor>& routing, const std::optional<at::Tensor>& residual) {
  const LinearDualGeometry g = check_linear_dual_inputs(x, mask, weight_v, weight_t, bias_v, bias_t, residual);
  check_routing(routing, g.M, x, "linear_dual", /*forward_routing=*/true);
  if (present(routing)) check_routing_of_mask(*routing, mask, "linear_dual");  // the CPU routes from the mask
  const auto ct = compute_type(x.scalar_type());
  const at::Tensor xr = x.reshape({g.M, g.K}).to(ct);
  const at::Tensor m = mask.reshape({g.M});
  at::Tensor out = at::zeros({g.M, g.N}, x.options().dtype(ct));
  const std::optional<at::Tensor>* biases[2] = {&bias_v, &bias_t};
  const auto [wv, wt] = expert_weights(weight_v, weight_t);
  const Expert experts[2] = {{m.nonzero().flatten(), wv}, {m.logical_not().nonzero().flatten(), wt}};
  for (int e = 0; e < 2; ++e) {
    if (experts[e].rows.numel() == 0) continue;
    at::Tensor y = xr.index_select(0, experts[e].rows).matmul(experts[e].weight.to(ct).t());
    if (present(*biases[e])) y.add_((*biases[e])->to(ct));
    out.index_copy_(0, experts[e].rows, y);
  }
  if (present(residual)) out.add_(residual->reshape({g.M, g.N}).to(ct));  // one rounding, as the CUDA epilogue
  return out.to(x.scalar_type()).reshape(with_last(x, g.N));
}

std::tuple<at::Tensor, at::Tensor> linear_dual_forward_cpu(const at::Tensor& x, const at::Tensor& mask,
                                                           const at::Tensor& weight_v, const OptTensor& weight_t,
                                                           const std::optional<at::Tensor>& bias_v,
                                                           const std::optional<at::Tensor>& bias_t, bool allow_tf32,
                                                           const std::optional<at::Tensor>& residual) {
  at::Tensor out = linear_dual_cpu(x, mask, weight_v, weight_t, bias_v, bias_t, allow_tf32, std::nullopt, residual);
  return {out, routing_cpu(mask, /*aligned=*/true)};
}

LinearDualGrads linear_dual_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mask,
                                         const at::Tensor& weight_v, const OptTensor& weight_t, bool /*allow_tf32*/,
                                         LinearDualOutputMask output_mask, const std::optional<at::Tensor>& routing) {
  const LinearDualGeometry g = check_linear_dual_backward_inputs(grad_out, x, mask, weight_v, weight_t);
  check_routing(routing, g.M, x, "linear_dual", /*forward_routing=*/true);
  if (present(routing)) check_routing_of_mask(*routing, mask, "linear_dual");  // the CPU routes from the mask
  const auto dt = x.scalar_type();
  const auto ct = compute_type(dt);
  const auto copt = x.options().dtype(ct);
  const at::Tensor xr = x.reshape({g.M, g.K}).to(ct);
  const at::Tensor dy = grad_out.reshape({g.M, g.N}).to(ct);
  const at::Tensor m = mask.reshape({g.M});
  const bool want_gx = output_mask[0];
  // stacked weights: slot 1 asks for the stacked gradient of both experts
  const bool want_gw[2] = {output_mask[1], g.stacked ? output_mask[1] : output_mask[2]};
  const bool want_gb[2] = {output_mask[3], output_mask[4]};
  at::Tensor gx = want_gx ? at::zeros({g.M, g.K}, copt) : at::Tensor();
  at::Tensor gw[2], gb[2];
  const auto [wv, wt] = expert_weights(weight_v, weight_t);
  const Expert experts[2] = {{m.nonzero().flatten(), wv}, {m.logical_not().nonzero().flatten(), wt}};
  for (int e = 0; e < 2; ++e) {
    const at::Tensor& rows = experts[e].rows;
    if (rows.numel() == 0) {
      if (want_gw[e]) gw[e] = at::zeros({g.N, g.K}, copt);
      if (want_gb[e]) gb[e] = at::zeros({g.N}, copt);
      continue;
    }
    const at::Tensor dye = dy.index_select(0, rows);
    if (want_gx) gx.index_copy_(0, rows, dye.matmul(experts[e].weight.to(ct)));
    if (want_gw[e]) gw[e] = dye.t().matmul(xr.index_select(0, rows));
    if (want_gb[e]) gb[e] = dye.sum(0);
  }
  const auto cast = [dt](const at::Tensor& t) { return t.defined() ? t.to(dt) : t; };
  at::Tensor gx_out = want_gx ? gx.to(dt).reshape(x.sizes()) : gx;
  if (g.stacked)  // [2, N, K]: text [0], vision [1]
    return {gx_out, want_gw[0] ? at::stack({gw[1], gw[0]}).to(dt) : at::Tensor(), at::Tensor(), cast(gb[0]),
            cast(gb[1])};
  return {gx_out, cast(gw[0]), cast(gw[1]), cast(gb[0]), cast(gb[1])};
}

}  // namespace fused

TORCH_LIBRARY_IMPL(fused, CPU, m) {
  m.impl("linear_dual", fused::linear_dual_cpu);
  m.impl("linear_dual_forward", fused::linear_dual_forward_cpu);
  m.impl("linear_dual_backward", fused::linear_dual_backward_cpu);
}
