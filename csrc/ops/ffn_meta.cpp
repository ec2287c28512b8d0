// What the ffn ops accept and what they return, in one place:
//  * the input checks (check_ffn_inputs*), which the CPU, CUDA and Meta kernels all run first;
//  * the Meta (shape) kernels: those checks plus the output shapes. torch.compile, torch.export and fake
//    tensors trace through them; sizes stay symbolic (*_symint), so one trace serves every shape.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops/ffn.h"
#include "ops/routed_gemm.h"

namespace fused {
namespace {
constexpr const char* kOp = "ffn";

FfnGeometry concrete(const FfnSymGeometry& g) {
  return {g.M.expect_int(), g.H.expect_int(), g.I.expect_int(), g.dual, g.stacked};
}
}  // namespace

FfnSymGeometry check_ffn_inputs_symint(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3,
                                       const at::Tensor& w2, const std::optional<at::Tensor>& mask,
                                       const std::optional<at::Tensor>& u1, const std::optional<at::Tensor>& u3,
                                       const std::optional<at::Tensor>& u2, const std::optional<at::Tensor>& routing) {
  TORCH_CHECK(x.dim() >= 1, kOp, ": x must have at least one dimension [..., H], got a scalar");
  check_routed_dtype(x, kOp, "x");
  const c10::SymInt H = x.sym_size(-1);
  // [I, H], or stacked [2, I, H] (both experts, text first)
  const bool stacked = w1.dim() == 3;
  TORCH_CHECK(w1.dim() == 2 || stacked, kOp, ": w1 (gate) must have shape [I, H] (or [2, I, H]: both experts "
              "stacked) with H = x.shape[-1] = ", H, ", got ", w1.sym_sizes());
  TORCH_SYM_CHECK(w1.sym_size(-1).sym_eq(H), kOp, ": w1 (gate) must have shape [I, H] (or [2, I, H]) with H = "
                  "x.shape[-1] = ", H, ", got ", w1.sym_sizes());
  FfnSymGeometry g{leading_rows(x), H, w1.sym_size(-2), false};
  g.stacked = stacked;
  check_like(w1, "w1", x, "x", kOp);
  check_like(w3, "w3", x, "x", kOp);
  check_like(w2, "w2", x, "x", kOp);
  TORCH_SYM_CHECK(sym_equal(w3.sym_sizes(), w1.sym_sizes()), kOp, ": w3 (up) must have the shape of w1 ",
                  w1.sym_sizes(), ", got ", w3.sym_sizes());
  if (stacked) {
    TORCH_SYM_CHECK(w1.sym_size(0).sym_eq(2), kOp, ": stacked w1 (gate) must have shape [2, I, H] (text, vision), got ",
                    w1.sym_sizes());
    TORCH_SYM_CHECK(sym_equal(w2.sym_sizes(), {2, g.H, g.I}), kOp, ": stacked w2 (down) must have shape [2, H, I] = "
                    "[2, ", g.H, ", ", g.I, "], got ", w2.sym_sizes());
  } else {
    TORCH_SYM_CHECK(sym_equal(w2.sym_sizes(), {g.H, g.I}), kOp, ": w2 (down) must have shape [H, I] = [", g.H, ", ",
                    g.I, "], got ", w2.sym_sizes());
  }

  const bool has_u1 = present(u1), has_u3 = present(u3), has_u2 = present(u2);
  g.dual = has_u1 || has_u3 || has_u2 || stacked;
  if (stacked) {
    TORCH_CHECK(!has_u1 && !has_u3 && !has_u2, kOp, ": stacked w1, w3, w2 ([2, ...]) hold both experts: u1, u3 and "
                "u2 must be None");
    TORCH_CHECK(present(mask), kOp, ": stacked w1, w3, w2 ([2, ...]: text, vision) need mask (true = vision tokens)");
    check_mask(*mask, x, kOp);
  } else if (g.dual) {
    TORCH_CHECK(has_u1 && has_u3 && has_u2, kOp, ": the dual-expert ffn needs all of u1, u3 and u2 (the text expert); ",
                !has_u1 ? "u1" : (!has_u3 ? "u3" : "u2"), " is missing");
    TORCH_CHECK(present(mask), kOp, ": the dual-expert ffn (u1, u3, u2 given) needs mask (true = vision tokens, "
                "which use w1, w3, w2)");
    check_like(*u1, "u1", x, "x", kOp);
    check_like(*u3, "u3", x, "x", kOp);
    check_like(*u2, "u2", x, "x", kOp);
    TORCH_SYM_CHECK(sym_equal(u1->sym_sizes(), w1.sym_sizes()), kOp, ": u1 must have the shape of w1 ",
                    w1.sym_sizes(), ", got ", u1->sym_sizes());
    TORCH_SYM_CHECK(sym_equal(u3->sym_sizes(), w3.sym_sizes()), kOp, ": u3 must have the shape of w3 ",
                    w3.sym_sizes(), ", got ", u3->sym_sizes());
    TORCH_SYM_CHECK(sym_equal(u2->sym_sizes(), w2.sym_sizes()), kOp, ": u2 must have the shape of w2 ",
                    w2.sym_sizes(), ", got ", u2->sym_sizes());
    check_mask(*mask, x, kOp);
  } else {
    TORCH_CHECK(!present(mask), kOp, ": mask is given but u1, u3, u2 are not: the single-expert ffn takes no mask "
                "(pass u1, u3, u2 for the dual expert)");
  }
  TORCH_CHECK(!present(routing) || g.dual, kOp, ": routing is given but u1, u3, u2 are not: only the dual-expert ffn "
              "is routed (routing = fused.route(mask))");
  check_routing(routing, g.M, x, kOp, /*forward_routing=*/false);
  return g;
}

FfnSymGeometry check_ffn_backward_inputs_symint(const at::Tensor& grad_out, const at::Tensor& x,
                                                const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2,
                                                const std::optional<at::Tensor>& mask,
                                                const std::optional<at::Tensor>& u1,
                                                const std::optional<at::Tensor>& u3,
                                                const std::optional<at::Tensor>& u2,
                                                const std::optional<at::Tensor>& routing) {
  FfnSymGeometry g = check_ffn_inputs_symint(x, w1, w3, w2, mask, u1, u3, u2, routing);
  check_like(grad_out, "grad_out", x, "x", kOp);
  TORCH_SYM_CHECK(sym_equal(grad_out.sym_sizes(), x.sym_sizes()), kOp,
                  ": grad_out must have the output's shape (that of x) ", x.sym_sizes(), ", got ",
                  grad_out.sym_sizes());
  return g;
}

void check_gate_up_symint(const at::Tensor& gate_up, const at::Tensor& x, const c10::SymInt& I, const char* op) {
  check_like(gate_up, "gate_up", x, "x", op);
  TORCH_SYM_CHECK(sym_equal(gate_up.sym_sizes(), with_last_symint(x, I * 2)), op,
                  ": gate_up (ffn_forward's saved activations) must have shape x.shape[:-1] + [2 * I] = ",
                  c10::SymIntArrayRef(with_last_symint(x, I * 2)), ", got ", gate_up.sym_sizes());
}

void check_gate_up(const at::Tensor& gate_up, const at::Tensor& x, int64_t I, const char* op) {
  check_gate_up_symint(gate_up, x, c10::SymInt(I), op);
}

void check_residual_symint(const std::optional<at::Tensor>& residual, const at::Tensor& x) {
  check_residual_shape(residual, x, x.sym_sizes(), "x's shape", kOp);
}

void check_residual(const std::optional<at::Tensor>& residual, const at::Tensor& x) {
  check_residual_symint(residual, x);
}

FfnGeometry check_ffn_inputs(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2,
                             const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& u1,
                             const std::optional<at::Tensor>& u3, const std::optional<at::Tensor>& u2,
                             const std::optional<at::Tensor>& routing) {
  return concrete(check_ffn_inputs_symint(x, w1, w3, w2, mask, u1, u3, u2, routing));
}

FfnGeometry check_ffn_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w1,
                                      const at::Tensor& w3, const at::Tensor& w2,
                                      const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& u1,
                                      const std::optional<at::Tensor>& u3, const std::optional<at::Tensor>& u2,
                                      const std::optional<at::Tensor>& routing) {
  return concrete(check_ffn_backward_inputs_symint(grad_out, x, w1, w3, w2, mask, u1, u3, u2, routing));
}

}  // namespace fused

namespace {
using at::Tensor;

Tensor fwd(const Tensor& x, FUSED_FFN_ARGS, const std::optional<Tensor>& routing, bool recompute,
           const std::optional<Tensor>& residual) {
  (void)allow_tf32;
  (void)recompute;
  fused::check_ffn_inputs_symint(x, w1, w3, w2, mask, u1, u3, u2, routing);
  fused::check_residual_symint(residual, x);
  return at::empty_symint(x.sym_sizes(), x.options());
}

std::tuple<Tensor, Tensor> fwd_saving(const Tensor& x, FUSED_FFN_ARGS, const std::optional<Tensor>& routing,
                                      const std::optional<Tensor>& residual) {
  (void)allow_tf32;
  const auto g = fused::check_ffn_inputs_symint(x, w1, w3, w2, mask, u1, u3, u2, routing);
  fused::check_residual_symint(residual, x);
  return {at::empty_symint(x.sym_sizes(), x.options()),
          at::empty_symint(fused::with_last_symint(x, g.I * 2), x.options())};
}

fused::FfnGrads bwd(const Tensor& grad_out, const Tensor& x, FUSED_FFN_ARGS, fused::FfnOutputMask output_mask,
                    const std::optional<Tensor>& routing, const std::optional<Tensor>& gate_up) {
  (void)allow_tf32;
  const auto g = fused::check_ffn_backward_inputs_symint(grad_out, x, w1, w3, w2, mask, u1, u3, u2, routing);
  if (fused::present(gate_up)) fused::check_gate_up_symint(*gate_up, x, g.I, "ffn_backward");
  const auto opt = x.options();
  fused::FfnGradArray out;
  if (output_mask[fused::kGradX]) out[fused::kGradX] = at::empty_symint(x.sym_sizes(), opt);
  const Tensor* weight[3] = {&w1, &w3, &w2};  // FfnProj order; each gradient has its weight's shape (u's: the same)
  for (int expert = 0; expert < (g.dual ? 2 : 1); ++expert)
    for (int proj : {fused::kGate, fused::kUp, fused::kDown}) {
      const int slot = fused::ffn_grad_slot(g, expert, proj);
      if (output_mask[slot]) out[slot] = at::empty_symint(weight[proj]->sym_sizes(), opt);
    }
  return fused::to_tuple(out);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Meta, m) {
  m.impl("ffn", fwd);
  m.impl("ffn_forward", fwd_saving);
  m.impl("ffn_backward", bwd);
}
