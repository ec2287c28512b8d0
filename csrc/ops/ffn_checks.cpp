#include <ATen/ATen.h>

#include "ops/ffn.h"
#include "ops/routed_gemm.h"

namespace fused {
namespace {
constexpr const char* kOp = "ffn";
}

FfnGeometry check_ffn_inputs(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2,
                             const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& u1,
                             const std::optional<at::Tensor>& u3, const std::optional<at::Tensor>& u2,
                             const std::optional<at::Tensor>& routing) {
  TORCH_CHECK(x.dim() >= 1, kOp, ": x must have at least one dimension [..., H], got a scalar");
  check_routed_dtype(x, kOp, "x");
  FfnGeometry g{};
  g.H = x.size(-1);
  TORCH_CHECK(w1.dim() == 2 && w1.size(1) == g.H, kOp, ": w1 (gate) must have shape [I, H] with H = x.shape[-1] = ",
              g.H, ", got ", w1.sizes());
  g.I = w1.size(0);
  check_like(w1, "w1", x, "x", kOp);
  check_like(w3, "w3", x, "x", kOp);
  check_like(w2, "w2", x, "x", kOp);
  TORCH_CHECK(w3.sizes() == w1.sizes(), kOp, ": w3 (up) must have the shape of w1 [I, H] = ", w1.sizes(), ", got ",
              w3.sizes());
  TORCH_CHECK(w2.dim() == 2 && w2.size(0) == g.H && w2.size(1) == g.I, kOp, ": w2 (down) must have shape [H, I] = [",
              g.H, ", ", g.I, "], got ", w2.sizes());

  const bool has_u1 = present(u1), has_u3 = present(u3), has_u2 = present(u2);
  g.dual = has_u1 || has_u3 || has_u2;
  if (g.dual) {
    TORCH_CHECK(has_u1 && has_u3 && has_u2, kOp, ": the dual-expert ffn needs all of u1, u3 and u2 (the text expert); ",
                !has_u1 ? "u1" : (!has_u3 ? "u3" : "u2"), " is missing");
    TORCH_CHECK(present(mask), kOp, ": the dual-expert ffn (u1, u3, u2 given) needs mask (true = vision tokens, "
                "which use w1, w3, w2)");
    check_like(*u1, "u1", x, "x", kOp);
    check_like(*u3, "u3", x, "x", kOp);
    check_like(*u2, "u2", x, "x", kOp);
    TORCH_CHECK(u1->sizes() == w1.sizes(), kOp, ": u1 must have the shape of w1 ", w1.sizes(), ", got ", u1->sizes());
    TORCH_CHECK(u3->sizes() == w3.sizes(), kOp, ": u3 must have the shape of w3 ", w3.sizes(), ", got ", u3->sizes());
    TORCH_CHECK(u2->sizes() == w2.sizes(), kOp, ": u2 must have the shape of w2 ", w2.sizes(), ", got ", u2->sizes());
    check_mask(*mask, x, kOp);
  } else {
    TORCH_CHECK(!present(mask), kOp, ": mask is given but u1, u3, u2 are not: the single-expert ffn takes no mask "
                "(pass u1, u3, u2 for the dual expert)");
  }
  g.M = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) g.M *= x.size(i);
  TORCH_CHECK(!present(routing) || g.dual, kOp, ": routing is given but u1, u3, u2 are not: only the dual-expert ffn "
              "is routed (routing = fused.route(mask))");
  check_routing(routing, g.M, x, kOp, /*forward_routing=*/false);
  return g;
}

FfnGeometry check_ffn_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w1,
                                      const at::Tensor& w3, const at::Tensor& w2,
                                      const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& u1,
                                      const std::optional<at::Tensor>& u3, const std::optional<at::Tensor>& u2,
                                      const std::optional<at::Tensor>& routing) {
  FfnGeometry g = check_ffn_inputs(x, w1, w3, w2, mask, u1, u3, u2, routing);
  check_like(grad_out, "grad_out", x, "x", kOp);
  TORCH_CHECK(grad_out.sizes() == x.sizes(), kOp, ": grad_out must have the output's shape (that of x) ", x.sizes(),
              ", got ", grad_out.sizes());
  return g;
}

}  // namespace fused
