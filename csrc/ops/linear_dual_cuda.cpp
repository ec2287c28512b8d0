// CUDA implementation of linear_dual on the routed GEMM core (csrc/ops/routed_gemm.h):
//   forward      route(mask) -> routed_linear (x gathered through perm, out scattered back), bias and residual in
//                the epilogue;
//                a decode step's few tokens (the table's decode buckets): the decode GEMM, no routing;
//   backward     route(mask), or the forward's routing -> grad_x = routed_linear(grad_out, W_e, W_TRANSPOSED)
//                             -> (dW_e, db_e) = routed_grad_weight(grad_out, x) in one pass
//                (TMA: grad_out and x gathered once into expert-ordered buffers that both GEMMs read; db_e summed
//                by grad_out's gather). Only the gradients of output_mask are computed: no grad-input GEMM
//                without grad_x, no x gather and no grad-weight programs for an expert without dW_e, no column
//                sums without db_e.
// Path: the Hopper TMA kernels on sm_90 when K and N are multiples of 16 elements (x / grad_out gathered into an
// expert-ordered buffer first, weights as one rank-3 descriptor; see Experts::stacked for when that copies), else
// the pointer kernels (an aligned variant with divisibility hints when pointers, K, N and strides allow, else the
// generic one; the runtime picks). Nothing syncs the host; M = 0 launches nothing (linear_dual_forward: only the
// routing it returns).
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops/linear_dual.h"
#include "ops/routed_gemm.h"
#include "ops/torch_launch.h"

namespace fused {
namespace {
constexpr const char* kOp = "linear_dual";

at::Tensor vec(const at::Tensor& b) { return b.is_contiguous() ? b : b.contiguous(); }

// The forward, on `given` (a routing of mask: check_routing) or routing mask itself; `return_routing`: also returns
// the routing it used (written in full, for linear_dual_backward).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                                           const OptTensor& weight_t, const std::optional<at::Tensor>& bias_v,
                                           const std::optional<at::Tensor>& bias_t, bool allow_tf32,
                                           const std::optional<at::Tensor>& given,
                                           const std::optional<at::Tensor>& residual, bool return_routing) {
  check_cuda(x, "x", kOp);
  check_cuda(mask, "mask", kOp);
  check_cuda(weight_v, "weight_v", kOp);
  if (present(weight_t)) check_cuda(*weight_t, "weight_t", kOp);
  if (present(bias_v)) check_cuda(*bias_v, "bias_v", kOp);
  if (present(bias_t)) check_cuda(*bias_t, "bias_t", kOp);
  if (present(residual)) check_cuda(*residual, "residual", kOp);
  const LinearDualGeometry geo = check_linear_dual_inputs(x, mask, weight_v, weight_t, bias_v, bias_t, residual);
  check_routing(given, geo.M, x, kOp, /*forward_routing=*/true);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({geo.M, geo.N}, x.options());
  if ((geo.M == 0 || geo.N == 0) && !return_routing) return {out.view(with_last(x, geo.N)), at::Tensor()};

  const routed::Gemm g = routed::Gemm::make(x, allow_tf32);
  at::Tensor b0, b1;  // expert 0 = text, 1 = vision; a missing bias of the two is zero
  if (geo.N > 0 && (present(bias_v) || present(bias_t))) {
    b0 = present(bias_t) ? vec(*bias_t) : zeros_for_reading(geo.N, x);
    b1 = present(bias_v) ? vec(*bias_v) : zeros_for_reading(geo.N, x);
  }
  // The residual's rows in out's layout ([M, N], row stride N): the epilogue reads it where it writes out.
  at::Tensor res;
  if (present(residual) && geo.N > 0) res = as_rows(*residual).contiguous();
  // A decode step's few tokens need no routing: the decode GEMM reads each row's expert from the mask, where the table
  // serves M (linear_dual_forward returns a routing for the backward, so it routes and takes the GEMMs below).
  const auto [wv, wt] = expert_weights(weight_v, weight_t);  // a stacked weight_v: views of its two halves
  if (!return_routing && geo.N > 0 &&
      routed::decode_linear(g, as_rows(x), mask.reshape({geo.M}).contiguous(), wt, wv, b0, b1, out, res))
    return {out.view(with_last(x, geo.N)), at::Tensor()};

  // A routing given: the gather GEMM reads it and routes nothing (2% of the forward at 4096 tokens).
  const routed::Routing r = present(given) ? routed::routing_of(*given, geo.M) : routed::route(mask);
  if (geo.M == 0 || geo.N == 0) {  // nothing to compute; the routing asked for is still written
    routed::ensure_routed(r);
    return {out.view(with_last(x, geo.N)), r.buffer};
  }
  routed::Experts w(wt, wv, /*single=*/false);
  // K = 0 takes the pointer kernel (no TMA descriptor of an empty dimension): out = bias_e (or 0).
  const bool tma = g.tma_usable({geo.K, geo.N}, /*swiglu=*/false);
  routed::linear(g, r, routed::tokens(as_rows(x)), w, b0, b1, routed::tokens(out), /*w_transposed=*/false, tma, res);
  // Every path of routed::linear leaves perm and seg written (by a routing kernel or by the GEMM that routed itself).
  return {out.view(with_last(x, geo.N)), return_routing ? r.buffer : at::Tensor()};
}
}  // namespace

at::Tensor linear_dual_cuda(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                            const OptTensor& weight_t, const std::optional<at::Tensor>& bias_v,
                            const std::optional<at::Tensor>& bias_t, bool allow_tf32,
                            const std::optional<at::Tensor>& routing, const std::optional<at::Tensor>& residual) {
  return std::get<0>(
      forward(x, mask, weight_v, weight_t, bias_v, bias_t, allow_tf32, routing, residual, /*return_routing=*/false));
}

std::tuple<at::Tensor, at::Tensor> linear_dual_forward_cuda(const at::Tensor& x, const at::Tensor& mask,
                                                            const at::Tensor& weight_v, const OptTensor& weight_t,
                                                            const std::optional<at::Tensor>& bias_v,
                                                            const std::optional<at::Tensor>& bias_t, bool allow_tf32,
                                                            const std::optional<at::Tensor>& residual) {
  return forward(x, mask, weight_v, weight_t, bias_v, bias_t, allow_tf32, std::nullopt, residual,
                 /*return_routing=*/true);
}

LinearDualGrads linear_dual_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mask,
                                          const at::Tensor& weight_v, const OptTensor& weight_t, bool allow_tf32,
                                          LinearDualOutputMask output_mask, const std::optional<at::Tensor>& routing) {
  check_cuda(grad_out, "grad_out", kOp);
  check_cuda(x, "x", kOp);
  check_cuda(mask, "mask", kOp);
  check_cuda(weight_v, "weight_v", kOp);
  if (present(weight_t)) check_cuda(*weight_t, "weight_t", kOp);
  const LinearDualGeometry geo = check_linear_dual_backward_inputs(grad_out, x, mask, weight_v, weight_t);
  check_routing(routing, geo.M, x, kOp, /*forward_routing=*/true);
  c10::cuda::CUDAGuard guard(x.device());
  const auto opt = x.options();
  // The outputs asked for (output_mask: grad_x, grad_weight_v, grad_weight_t, grad_bias_v, grad_bias_t); the others
  // stay undefined. Expert 0 = text, 1 = vision, as the routing numbers them.
  const auto maybe = [&](int i, at::IntArrayRef size) { return output_mask[i] ? at::empty(size, opt) : at::Tensor(); };
  at::Tensor gx = maybe(0, x.sizes());
  // Stacked weights: one [2, N, K] gradient (slot 1; slot 2 unused), each expert's written into its half.
  const at::Tensor gw_stacked = geo.stacked ? maybe(1, {2, geo.N, geo.K}) : at::Tensor();
  at::Tensor gw[2];
  if (!geo.stacked) {
    gw[0] = maybe(2, {geo.N, geo.K});
    gw[1] = maybe(1, {geo.N, geo.K});
  } else if (gw_stacked.defined()) {
    gw[0] = gw_stacked.select(0, 0);
    gw[1] = gw_stacked.select(0, 1);
  }
  at::Tensor gb[2] = {maybe(4, {geo.N}), maybe(3, {geo.N})};
  const auto result = [&]() -> LinearDualGrads {
    if (geo.stacked) return {gx, gw_stacked, at::Tensor(), gb[1], gb[0]};
    return {gx, gw[1], gw[0], gb[1], gb[0]};
  };
  const bool want_gx = gx.defined(), any_gw = gw[0].defined() || gw[1].defined();
  const bool any_gb = gb[0].defined() || gb[1].defined();
  if (geo.M == 0 || geo.N == 0) {  // no rows, or no output features: every gradient is zero (or empty)
    for (at::Tensor* t : {&gx, &gw[0], &gw[1], &gb[0], &gb[1]})
      if (t->defined()) t->zero_();
    return result();
  }
  const at::Tensor dy = as_rows(grad_out);
  if (geo.K == 0) {  // no input features: grad_x and the weight gradients are empty; db_e = Σ_{rows of e} dy
    const at::Tensor dyf = dy.to(at::kFloat);
    const at::Tensor m = mask.reshape({geo.M, 1});
    if (gb[1].defined()) gb[1].copy_((dyf * m).sum(0));
    if (gb[0].defined()) gb[0].copy_((dyf * m.logical_not()).sum(0));
    return result();
  }
  if (!want_gx && !any_gw && !any_gb) return result();

  const routed::Gemm g = routed::Gemm::make(x, allow_tf32);
  // The forward's routing (what autograd passes) or route()'s when given: no routing launch here.
  const routed::Routing r = present(routing) ? routed::routing_of(*routing, geo.M) : routed::route(mask);
  const auto [wv, wt] = expert_weights(weight_v, weight_t);
  routed::Experts w(wt, wv, /*single=*/false);
  const bool tma = g.tma_usable({geo.K, geo.N}, /*swiglu=*/false);
  // TMA: dy gathered once into an expert-ordered buffer that the grad-input and grad-weight GEMMs share, x only
  // where a weight gradient is asked for; the bias gradients are summed by dy's gather. Pointer path: token order,
  // rows through perm in the kernels (the grad-weight kernel sums the biases itself, for the experts it runs).
  const routed::Rows dya = !tma     ? routed::tokens(dy)
                           : any_gb ? routed::ordered(routed::gather_rows_and_sum(g, r, dy, gb[0], gb[1]))
                                    : routed::ordered(routed::gather_rows(g, r, dy));
  if (want_gx)
    routed::linear(g, r, dya, w, at::Tensor(), at::Tensor(), routed::tokens(gx.view({geo.M, geo.K})),
                   /*w_transposed=*/true, tma);
  if (!any_gw && (tma || !any_gb)) return result();
  const routed::Rows xa = tma ? routed::ordered(routed::gather_rows(g, r, as_rows(x))) : routed::tokens(as_rows(x));
  // Only the experts with an output asked for run (routed::grad_weight).
  routed::grad_weight(g, r, dya, xa, gw[0], gw[1], tma ? at::Tensor() : gb[0], tma ? at::Tensor() : gb[1], tma);
  return result();
}

}  // namespace fused

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("linear_dual", fused::linear_dual_cuda);
  m.impl("linear_dual_forward", fused::linear_dual_forward_cuda);
  m.impl("linear_dual_backward", fused::linear_dual_backward_cuda);
}
