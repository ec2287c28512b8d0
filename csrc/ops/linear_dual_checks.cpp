#include <ATen/ATen.h>

#include "ops/linear_dual.h"
#include "ops/routed_gemm.h"

namespace fused {
namespace {
constexpr const char* kOp = "linear_dual";
}

LinearDualGeometry check_linear_dual_inputs(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                                            const at::Tensor& weight_t, const std::optional<at::Tensor>& bias_v,
                                            const std::optional<at::Tensor>& bias_t) {
  TORCH_CHECK(x.dim() >= 1, kOp, ": x must have at least one dimension [..., K], got a scalar");
  check_routed_dtype(x, kOp, "x");
  TORCH_CHECK(weight_v.dim() == 2, kOp, ": weight_v must have shape [N, K] (nn.Linear layout), got ",
              weight_v.sizes());
  check_like(weight_v, "weight_v", x, "x", kOp);
  check_like(weight_t, "weight_t", x, "x", kOp);
  TORCH_CHECK(weight_t.sizes() == weight_v.sizes(), kOp, ": weight_t must have the shape of weight_v ",
              weight_v.sizes(), ", got ", weight_t.sizes());
  LinearDualGeometry g{};
  g.N = weight_v.size(0);
  g.K = weight_v.size(1);
  TORCH_CHECK(x.size(-1) == g.K, kOp, ": x's last dimension (", x.size(-1),
              ") must equal the in features K of weight_v / weight_t [N, K] = ", weight_v.sizes());
  check_mask(mask, x, kOp);
  g.M = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) g.M *= x.size(i);
  for (const auto& [b, what] : {std::make_pair(&bias_v, "bias_v"), std::make_pair(&bias_t, "bias_t")}) {
    if (!present(*b)) continue;
    check_like(**b, what, x, "x", kOp);
    TORCH_CHECK((*b)->dim() == 1 && (*b)->size(0) == g.N, kOp, ": ", what, " must have shape [N] = [", g.N,
                "], got ", (*b)->sizes());
  }
  return g;
}

LinearDualGeometry check_linear_dual_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                                                     const at::Tensor& mask, const at::Tensor& weight_v,
                                                     const at::Tensor& weight_t) {
  LinearDualGeometry g = check_linear_dual_inputs(x, mask, weight_v, weight_t, std::nullopt, std::nullopt);
  check_like(grad_out, "grad_out", x, "x", kOp);
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(with_last(x, g.N)), kOp,
              ": grad_out must have the output's shape x.shape[:-1] + [N] = ", at::IntArrayRef(with_last(x, g.N)),
              ", got ", grad_out.sizes());
  return g;
}

}  // namespace fused
