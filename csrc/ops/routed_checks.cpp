// Input checks shared by the routed GEMM ops (linear_dual, ffn) on every backend. Sizes are read as c10::SymInt
// (sym_sizes): the Meta kernels run these checks on symbolic sizes (sym_equal in csrc/ops/routed_gemm.h).
#include <ATen/core/Tensor.h>

#include "ops/routed_gemm.h"

namespace fused {

void check_routed_dtype(const at::Tensor& t, const char* op, const char* what) {
  const auto dt = t.scalar_type();
  const bool cpu_like = t.device().is_cpu() || t.device().is_meta();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || (cpu_like && dt == at::kDouble), op,
              ": ", what, " must be float32, float16 or bfloat16", cpu_like ? " (or float64 on the CPU)" : "",
              ", got ", dt);
}

void check_like(const at::Tensor& t, const char* what, const at::Tensor& ref, const char* ref_what, const char* op) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", what, " is on ", t.device(), " but ", ref_what, " is on ",
              ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", what, " has dtype ", t.scalar_type(), " but ", ref_what,
              " has ", ref.scalar_type(), " (all floating-point arguments must share one dtype)");
}

c10::SymBool sym_equal(c10::SymIntArrayRef a, c10::SymIntArrayRef b) {
  if (a.size() != b.size()) return c10::SymBool(false);
  c10::SymBool eq(true);
  for (size_t i = 0; i < a.size(); ++i) eq = eq.sym_and(a[i].sym_eq(b[i]));
  return eq;
}

void check_residual_shape(const std::optional<at::Tensor>& residual, const at::Tensor& x, c10::SymIntArrayRef want,
                          const char* want_what, const char* op) {
  if (!present(residual)) return;
  check_like(*residual, "residual", x, "x", op);
  TORCH_SYM_CHECK(sym_equal(residual->sym_sizes(), want), op, ": residual must have ", want_what, " ", want,
                  " (the block's input that the output is added to), got ", residual->sym_sizes());
}

c10::SymInt leading_rows(const at::Tensor& x) {
  c10::SymInt M = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) M *= x.sym_size(i);
  return M;
}

void check_mask(const at::Tensor& mask, const at::Tensor& x, const char* op) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, op, ": mask must be a bool tensor, got ", mask.scalar_type());
  TORCH_CHECK(mask.device() == x.device(), op, ": mask is on ", mask.device(), " but x is on ", x.device());
  const auto lead = x.sym_sizes().slice(0, x.dim() - 1);
  TORCH_SYM_CHECK(sym_equal(mask.sym_sizes(), lead), op, ": mask must have x's leading shape ", lead, " (x is ",
                  x.sym_sizes(), "), got ", mask.sym_sizes());
}

void check_cuda(const at::Tensor& t, const char* what, const char* op) {
  TORCH_CHECK(t.is_cuda(), op, ": ", what, " must be a CUDA tensor, got one on ", t.device());
}

void check_routing(const std::optional<at::Tensor>& routing, const c10::SymInt& M, const at::Tensor& x, const char* op,
                   bool forward_routing) {
  if (!present(routing)) return;
  const at::Tensor& r = *routing;
  const char* from = forward_routing ? "fused.route(mask) or linear_dual_forward" : "fused.route(mask)";
  TORCH_CHECK(r.scalar_type() == at::kInt && r.dim() == 1, op, ": routing must be a 1-D int32 tensor (the routing of ",
              from, "), got ", r.scalar_type(), " of shape ", r.sym_sizes());
  TORCH_CHECK(r.device() == x.device(), op, ": routing must be on x's device ", x.device(), ", got ", r.device());
  const c10::SymInt shared = routed::shared_routing_size(M), aligned = routed::routing_buffer_size(M);
  const auto n = r.sym_size(0);
  if (forward_routing) {
    TORCH_SYM_CHECK(n.sym_eq(shared).sym_or(n.sym_eq(aligned)), op, ": routing must have ", shared,
                    " elements (fused.route) or ", aligned, " (linear_dual_forward) for a mask of ", M,
                    " tokens, got ", n, " (not the routing of this mask)");
  } else {
    TORCH_SYM_CHECK(n.sym_eq(shared), op, ": routing must have ", shared, " elements (fused.route) for a mask of ", M,
                    " tokens, got ", n, " (not the routing of this mask)");
  }
  TORCH_SYM_CHECK(r.sym_stride(0).sym_eq(1), op, ": routing must be contiguous, got stride ", r.sym_stride(0));
}

std::vector<int64_t> with_last(const at::Tensor& x, int64_t last) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = last;
  return s;
}

std::vector<c10::SymInt> with_last_symint(const at::Tensor& x, const c10::SymInt& last) {
  std::vector<c10::SymInt> s(x.sym_sizes().begin(), x.sym_sizes().end());
  s.back() = last;
  return s;
}

at::Tensor as_rows(const at::Tensor& x) {
  const int64_t C = x.size(-1);
  int64_t M = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) M *= x.size(i);
  at::Tensor r = x.reshape({M, C});
  // The kernels need a unit stride along the row; any row stride works (a size-1 dimension's stride is unused).
  if (C > 1 && r.stride(1) != 1) r = r.contiguous();
  return r;
}

}  // namespace fused
