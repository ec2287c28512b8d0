// CUDA implementation of linear_dual on the routed GEMM core (csrc/ops/routed_gemm.h):
//   forward      route(mask) -> routed_linear (x gathered through perm, out scattered back), bias in the epilogue;
//   backward     route(mask) -> grad_x = routed_linear(grad_out, W_e, W_TRANSPOSED)
//                             -> (dW_e, db_e) = routed_grad_weight(grad_out, x) in one pass
//                (TMA: grad_out and x gathered once into expert-ordered buffers that both GEMMs read; db_e summed
//                by grad_out's gather).
// Path: the Hopper TMA kernels on sm_90 when K and N are multiples of 16 bytes (x / grad_out gathered into an
// expert-ordered buffer first, weights as one rank-3 descriptor; see Experts::stacked for when that copies), else
// the pointer kernels (an aligned variant with divisibility hints when pointers, K, N and strides allow, else the
// generic one; the runtime picks). Nothing syncs the host; M = 0 launches nothing.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops/linear_dual.h"
#include "ops/routed_gemm.h"

namespace fused {
namespace {
constexpr const char* kOp = "linear_dual";

at::Tensor vec(const at::Tensor& b) { return b.is_contiguous() ? b : b.contiguous(); }
}  // namespace

at::Tensor linear_dual_cuda(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                            const at::Tensor& weight_t, const std::optional<at::Tensor>& bias_v,
                            const std::optional<at::Tensor>& bias_t, bool allow_tf32) {
  check_cuda(x, "x", kOp);
  check_cuda(mask, "mask", kOp);
  check_cuda(weight_v, "weight_v", kOp);
  check_cuda(weight_t, "weight_t", kOp);
  if (present(bias_v)) check_cuda(*bias_v, "bias_v", kOp);
  if (present(bias_t)) check_cuda(*bias_t, "bias_t", kOp);
  const LinearDualGeometry geo = check_linear_dual_inputs(x, mask, weight_v, weight_t, bias_v, bias_t);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({geo.M, geo.N}, x.options());
  if (geo.M == 0 || geo.N == 0) return out.view(with_last(x, geo.N));

  const routed::Gemm g = routed::Gemm::make(x, allow_tf32);
  const routed::Routing r = routed::route(mask);
  routed::Experts w(weight_t, weight_v, /*single=*/false);  // expert 0 = text, 1 = vision
  at::Tensor b0, b1;                                         // a missing bias of the two is zero
  if (present(bias_v) || present(bias_t)) {
    b0 = present(bias_t) ? vec(*bias_t) : at::zeros({geo.N}, x.options());
    b1 = present(bias_v) ? vec(*bias_v) : at::zeros({geo.N}, x.options());
  }
  // K = 0 takes the pointer kernel (no TMA descriptor of an empty dimension): out = bias_e (or 0).
  const bool tma = g.tma_usable({geo.K, geo.N}, /*swiglu=*/false);
  routed::linear(g, r, routed::tokens(as_rows(x)), w, b0, b1, routed::tokens(out), /*w_transposed=*/false, tma);
  return out.view(with_last(x, geo.N));
}

LinearDualGrads linear_dual_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mask,
                                          const at::Tensor& weight_v, const at::Tensor& weight_t, bool allow_tf32) {
  check_cuda(grad_out, "grad_out", kOp);
  check_cuda(x, "x", kOp);
  check_cuda(mask, "mask", kOp);
  check_cuda(weight_v, "weight_v", kOp);
  check_cuda(weight_t, "weight_t", kOp);
  const LinearDualGeometry geo = check_linear_dual_backward_inputs(grad_out, x, mask, weight_v, weight_t);
  c10::cuda::CUDAGuard guard(x.device());
  const auto opt = x.options();
  at::Tensor gx = at::empty(x.sizes(), opt);
  at::Tensor gw_v = at::empty({geo.N, geo.K}, opt), gw_t = at::empty({geo.N, geo.K}, opt);
  at::Tensor gb_v = at::empty({geo.N}, opt), gb_t = at::empty({geo.N}, opt);
  if (geo.M == 0 || geo.N == 0) {  // no rows, or no output features: every gradient is zero (or empty)
    for (at::Tensor* t : {&gx, &gw_v, &gw_t, &gb_v, &gb_t}) t->zero_();
    return {gx, gw_v, gw_t, gb_v, gb_t};
  }
  const at::Tensor dy = as_rows(grad_out);
  if (geo.K == 0) {  // no input features: grad_x and the weight gradients are empty; db_e = Σ_{rows of e} dy
    const at::Tensor dyf = dy.to(at::kFloat);
    const at::Tensor m = mask.reshape({geo.M, 1});
    gb_v.copy_((dyf * m).sum(0));
    gb_t.copy_((dyf * m.logical_not()).sum(0));
    return {gx, gw_v, gw_t, gb_v, gb_t};
  }

  const routed::Gemm g = routed::Gemm::make(x, allow_tf32);
  const routed::Routing r = routed::route(mask);
  routed::Experts w(weight_t, weight_v, /*single=*/false);
  const bool tma = g.tma_usable({geo.K, geo.N}, /*swiglu=*/false);
  // TMA: dy and x gathered once into expert-ordered buffers that the grad-input and grad-weight GEMMs share; the
  // bias gradients are summed by dy's gather (the pointer grad-weight kernel sums them itself).
  const routed::Rows dya =
      tma ? routed::ordered(routed::gather_rows_and_sum(g, r, dy, gb_t, gb_v)) : routed::tokens(dy);
  const routed::Rows xa = tma ? routed::ordered(routed::gather_rows(g, r, as_rows(x))) : routed::tokens(as_rows(x));
  routed::linear(g, r, dya, w, at::Tensor(), at::Tensor(), routed::tokens(gx.view({geo.M, geo.K})),
                 /*w_transposed=*/true, tma);
  routed::grad_weight(g, r, dya, xa, gw_t, gw_v, tma ? at::Tensor() : gb_t, tma ? at::Tensor() : gb_v, tma);
  return {gx, gw_v, gw_t, gb_v, gb_t};
}

}  // namespace fused
