// What the linear_dual ops accept and what they return, in one place:
//  * the input checks (check_linear_dual_inputs*), which the CPU, CUDA and Meta kernels all run first;
//  * the Meta (shape) kernels: those checks plus the output shapes. torch.compile, torch.export and fake
//    tensors trace through them; sizes stay symbolic (*_symint), so one trace serves every shape.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops/linear_dual.h"
#include "ops/routed_gemm.h"

namespace fused {
namespace {
constexpr const char* kOp = "linear_dual";

LinearDualGeometry concrete(const LinearDualSymGeometry& g) {
  return {g.M.expect_int(), g.K.expect_int(), g.N.expect_int(), g.stacked};
}
}  // namespace

LinearDualSymGeometry check_linear_dual_inputs_symint(const at::Tensor& x, const at::Tensor& mask,
                                                      const at::Tensor& weight_v,
                                                      const std::optional<at::Tensor>& weight_t,
                                                      const std::optional<at::Tensor>& bias_v,
                                                      const std::optional<at::Tensor>& bias_t,
                                                      const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() >= 1, kOp, ": x must have at least one dimension [..., K], got a scalar");
  check_routed_dtype(x, kOp, "x");
  check_like(weight_v, "weight_v", x, "x", kOp);
  const bool stacked = !present(weight_t);
  if (stacked) {
    TORCH_CHECK(weight_v.dim() == 3, kOp, ": without weight_t, weight_v must hold both experts stacked, [2, N, K] "
                "(text [0], vision [1]), got ", weight_v.sym_sizes());
    TORCH_SYM_CHECK(weight_v.sym_size(0).sym_eq(2), kOp, ": stacked weight_v must have shape [2, N, K] (text [0], "
                    "vision [1]), got ", weight_v.sym_sizes());
  } else {
    TORCH_CHECK(weight_v.dim() == 2, kOp, ": weight_v must have shape [N, K] (nn.Linear layout; or both experts "
                "[2, N, K] with weight_t None), got ", weight_v.sym_sizes());
    check_like(*weight_t, "weight_t", x, "x", kOp);
    TORCH_SYM_CHECK(sym_equal(weight_t->sym_sizes(), weight_v.sym_sizes()), kOp,
                    ": weight_t must have the shape of weight_v ", weight_v.sym_sizes(), ", got ",
                    weight_t->sym_sizes());
  }
  LinearDualSymGeometry g{leading_rows(x), weight_v.sym_size(-1), weight_v.sym_size(-2), stacked};
  TORCH_SYM_CHECK(x.sym_size(-1).sym_eq(g.K), kOp, ": x's last dimension (", x.sym_size(-1),
                  ") must equal the in features K of the weights [.., N, K] = ", weight_v.sym_sizes());
  check_mask(mask, x, kOp);
  for (const auto& [b, what] : {std::make_pair(&bias_v, "bias_v"), std::make_pair(&bias_t, "bias_t")}) {
    if (!present(*b)) continue;
    check_like(**b, what, x, "x", kOp);
    TORCH_CHECK((*b)->dim() == 1, kOp, ": ", what, " must have shape [N] = [", g.N, "], got ", (*b)->sym_sizes());
    TORCH_SYM_CHECK((*b)->sym_size(0).sym_eq(g.N), kOp, ": ", what, " must have shape [N] = [", g.N, "], got ",
                    (*b)->sym_sizes());
  }
  if (present(residual))
    check_residual_shape(residual, x, with_last_symint(x, g.N), "the output's shape x.shape[:-1] + [N] =", kOp);
  return g;
}

LinearDualSymGeometry check_linear_dual_backward_inputs_symint(const at::Tensor& grad_out, const at::Tensor& x,
                                                               const at::Tensor& mask, const at::Tensor& weight_v,
                                                               const std::optional<at::Tensor>& weight_t) {
  LinearDualSymGeometry g =
      check_linear_dual_inputs_symint(x, mask, weight_v, weight_t, std::nullopt, std::nullopt, std::nullopt);
  check_like(grad_out, "grad_out", x, "x", kOp);
  const auto want = with_last_symint(x, g.N);
  TORCH_SYM_CHECK(sym_equal(grad_out.sym_sizes(), want), kOp,
                  ": grad_out must have the output's shape x.shape[:-1] + [N] = ", c10::SymIntArrayRef(want), ", got ",
                  grad_out.sym_sizes());
  return g;
}

LinearDualGeometry check_linear_dual_inputs(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                                            const std::optional<at::Tensor>& weight_t,
                                            const std::optional<at::Tensor>& bias_v,
                                            const std::optional<at::Tensor>& bias_t,
                                            const std::optional<at::Tensor>& residual) {
  return concrete(check_linear_dual_inputs_symint(x, mask, weight_v, weight_t, bias_v, bias_t, residual));
}

LinearDualGeometry check_linear_dual_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                                                     const at::Tensor& mask, const at::Tensor& weight_v,
                                                     const std::optional<at::Tensor>& weight_t) {
  return concrete(check_linear_dual_backward_inputs_symint(grad_out, x, mask, weight_v, weight_t));
}

std::pair<at::Tensor, at::Tensor> expert_weights(const at::Tensor& weight_v, const OptTensor& weight_t) {
  if (present(weight_t)) return {weight_v, *weight_t};
  return {weight_v.select(0, 1), weight_v.select(0, 0)};  // views: text [0], vision [1]
}

}  // namespace fused

namespace {
using at::Tensor;

Tensor fwd(const Tensor& x, const Tensor& mask, const Tensor& weight_v, const std::optional<Tensor>& weight_t,
           const std::optional<Tensor>& bias_v, const std::optional<Tensor>& bias_t, bool /*allow_tf32*/,
           const std::optional<Tensor>& routing, const std::optional<Tensor>& residual) {
  const auto g = fused::check_linear_dual_inputs_symint(x, mask, weight_v, weight_t, bias_v, bias_t, residual);
  fused::check_routing(routing, g.M, x, "linear_dual", /*forward_routing=*/true);
  return at::empty_symint(fused::with_last_symint(x, g.N), x.options());
}

std::tuple<Tensor, Tensor> fwd_routing(const Tensor& x, const Tensor& mask, const Tensor& weight_v,
                                      const std::optional<Tensor>& weight_t, const std::optional<Tensor>& bias_v,
                                      const std::optional<Tensor>& bias_t, bool /*allow_tf32*/,
                                      const std::optional<Tensor>& residual) {
  const auto g = fused::check_linear_dual_inputs_symint(x, mask, weight_v, weight_t, bias_v, bias_t, residual);
  return {at::empty_symint(fused::with_last_symint(x, g.N), x.options()),
          at::empty_symint({fused::routed::routing_buffer_size(g.M)}, x.options().dtype(at::kInt))};
}

fused::LinearDualGrads bwd(const Tensor& grad_out, const Tensor& x, const Tensor& mask, const Tensor& weight_v,
                           const std::optional<Tensor>& weight_t, bool /*allow_tf32*/,
                           fused::LinearDualOutputMask output_mask,
                           const std::optional<Tensor>& routing) {
  const auto g = fused::check_linear_dual_backward_inputs_symint(grad_out, x, mask, weight_v, weight_t);
  fused::check_routing(routing, g.M, x, "linear_dual", /*forward_routing=*/true);
  const auto opt = x.options();
  const auto out = [&](int i, c10::SymIntArrayRef size) {
    return output_mask[i] ? at::empty_symint(size, opt) : Tensor();
  };
  if (g.stacked) return {out(0, x.sym_sizes()), out(1, {2, g.N, g.K}), Tensor(), out(3, {g.N}), out(4, {g.N})};
  return {out(0, x.sym_sizes()), out(1, {g.N, g.K}), out(2, {g.N, g.K}), out(3, {g.N}), out(4, {g.N})};
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Meta, m) {
  m.impl("linear_dual", fwd);
  m.impl("linear_dual_forward", fwd_routing);
  m.impl("linear_dual_backward", bwd);
}
