// linear_dual: the modality-routed linear (docs/design.md "Routed GEMM ops"): shared checks and backends.
//   out[i] = x[i]·weight_vᵀ + bias_v if mask[i] (vision) else x[i]·weight_tᵀ + bias_t (text)
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace fused {

template <typename Int>
struct LinearDualGeometryOf {
  Int M;  // rows: the product of x's leading dimensions
  Int K;  // in features
  Int N;  // out features
  bool stacked;  // both experts' weights in weight_v [2, N, K] (text [0], vision [1]), weight_t None
};
using LinearDualGeometry = LinearDualGeometryOf<int64_t>;
using LinearDualSymGeometry = LinearDualGeometryOf<c10::SymInt>;

// Shapes, dtypes and devices (no data read). The weights: weight_v and weight_t [N, K], or both experts stacked in
// weight_v [2, N, K] (text [0], vision [1], as DualLinear holds them) with weight_t None: one tensor in, its gradient
// one [2, N, K] tensor out (no stacking copy in autograd). A missing bias counts as zero, so one of the two biases may
// be given alone; a residual has the output's shape x.shape[:-1] + [N] and x's dtype and device. The _symint checks
// read symbolic sizes (the Meta kernels: torch.export / torch.compile with dynamic shapes) and guard only the
// relations the op needs (csrc/ops/routed_gemm.h, sym_equal); the others are the same checks on concrete tensors (the
// CPU and CUDA kernels).
using OptTensor = std::optional<at::Tensor>;
LinearDualSymGeometry check_linear_dual_inputs_symint(const at::Tensor& x, const at::Tensor& mask,
                                                      const at::Tensor& weight_v, const OptTensor& weight_t,
                                                      const OptTensor& bias_v, const OptTensor& bias_t,
                                                      const OptTensor& residual);
LinearDualSymGeometry check_linear_dual_backward_inputs_symint(const at::Tensor& grad_out, const at::Tensor& x,
                                                               const at::Tensor& mask, const at::Tensor& weight_v,
                                                               const OptTensor& weight_t);
LinearDualGeometry check_linear_dual_inputs(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                                            const OptTensor& weight_t, const OptTensor& bias_v,
                                            const OptTensor& bias_t, const OptTensor& residual);
LinearDualGeometry check_linear_dual_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                                                     const at::Tensor& mask, const at::Tensor& weight_v,
                                                     const OptTensor& weight_t);

// The experts' [N, K] weights (vision, text): weight_v and weight_t, or views of a stacked weight_v.
std::pair<at::Tensor, at::Tensor> expert_weights(const at::Tensor& weight_v, const OptTensor& weight_t);

// The routing of linear_dual_forward: int32 [M + 264]. Slots 0-4 hold seg = [0, start_1, end, count_0, count_1],
// slots 5-7 are unused (they keep perm 16-byte aligned), slots [8, 8 + M_pad) perm with M_pad = (ceil(M / 128) + 1) *
// 128: the row list in expert order, text rows (mask false) from 0 and vision rows from start_1 = roundup(count_0,
// 128), each in token order and padded with -1 to a multiple of 128, -1 up to M_pad (kernels/GEMM.md, routing); the
// rest is unused: routed::routing_buffer_size(M) entries (csrc/ops/routed_gemm.h). The length pins M, so a routing of
// another number of tokens is rejected. linear_dual_backward's `routing` argument takes it; every linear_dual op's
// `routing` also takes the `route` op's shared routing, whose first section it is (csrc/ops/routed_gemm.h,
// check_routing).

using LinearDualGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// Which of the gradients to compute, in LinearDualGrads' order (grad_x, grad_weight_v, grad_weight_t, grad_bias_v,
// grad_bias_t): the others are returned undefined and cost nothing (a frozen expert's weights, a layer without
// biases, an input that needs no gradient). Stacked weights: grad_weight_v is the stacked [2, N, K] gradient (slot 1
// asks for it) and grad_weight_t is undefined; the bias gradients stay per expert.
using LinearDualOutputMask = std::array<bool, 5>;
// The ops' signatures (csrc/torch_bindings.cpp), for calls through the dispatcher: .typed<LinearDualOp>().
using LinearDualOp = at::Tensor(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                                const OptTensor& weight_t, const OptTensor& bias_v, const OptTensor& bias_t,
                                bool allow_tf32, const OptTensor& routing, const OptTensor& residual);
// linear_dual_forward: (out, routing), the routing for linear_dual_backward (what autograd saves).
using LinearDualForwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& x, const at::Tensor& mask,
                                                               const at::Tensor& weight_v, const OptTensor& weight_t,
                                                               const OptTensor& bias_v, const OptTensor& bias_t,
                                                               bool allow_tf32, const OptTensor& residual);
using LinearDualBackwardOp = LinearDualGrads(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mask,
                                             const at::Tensor& weight_v, const OptTensor& weight_t, bool allow_tf32,
                                             LinearDualOutputMask output_mask, const OptTensor& routing);

// CPU: the ATen reference (each token only through its own expert; math in fp32, fp64 for fp64 inputs).
at::Tensor linear_dual_cpu(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                           const OptTensor& weight_t, const OptTensor& bias_v, const OptTensor& bias_t,
                           bool allow_tf32, const OptTensor& routing, const OptTensor& residual);
std::tuple<at::Tensor, at::Tensor> linear_dual_forward_cpu(const at::Tensor& x, const at::Tensor& mask,
                                                           const at::Tensor& weight_v, const OptTensor& weight_t,
                                                           const OptTensor& bias_v, const OptTensor& bias_t,
                                                           bool allow_tf32, const OptTensor& residual);
LinearDualGrads linear_dual_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mask,
                                         const at::Tensor& weight_v, const OptTensor& weight_t, bool allow_tf32,
                                         LinearDualOutputMask output_mask, const OptTensor& routing);
// CUDA: routing + the routed GEMM kernels (csrc/ops/routed_gemm.h).
at::Tensor linear_dual_cuda(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                            const OptTensor& weight_t, const OptTensor& bias_v, const OptTensor& bias_t,
                            bool allow_tf32, const OptTensor& routing, const OptTensor& residual);
std::tuple<at::Tensor, at::Tensor> linear_dual_forward_cuda(const at::Tensor& x, const at::Tensor& mask,
                                                            const at::Tensor& weight_v, const OptTensor& weight_t,
                                                            const OptTensor& bias_v, const OptTensor& bias_t,
                                                            bool allow_tf32, const OptTensor& residual);
LinearDualGrads linear_dual_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mask,
                                          const at::Tensor& weight_v, const OptTensor& weight_t, bool allow_tf32,
                                          LinearDualOutputMask output_mask, const OptTensor& routing);

}  // namespace fused
