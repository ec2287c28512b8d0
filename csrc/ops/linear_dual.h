// linear_dual: the modality-routed linear (docs/design.md "Routed GEMM ops"): shared checks and backends.
//   out[i] = x[i]·weight_vᵀ + bias_v if mask[i] (vision) else x[i]·weight_tᵀ + bias_t (text)
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace fused {

struct LinearDualGeometry {
  int64_t M;  // rows: the product of x's leading dimensions
  int64_t K;  // in features
  int64_t N;  // out features
};

// Shapes, dtypes and devices (no data read; also run by the Meta kernels). A missing bias counts as zero, so one
// of the two biases may be given alone.
LinearDualGeometry check_linear_dual_inputs(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                                            const at::Tensor& weight_t, const std::optional<at::Tensor>& bias_v,
                                            const std::optional<at::Tensor>& bias_t);
LinearDualGeometry check_linear_dual_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                                                     const at::Tensor& mask, const at::Tensor& weight_v,
                                                     const at::Tensor& weight_t);

using LinearDualGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// Which of the gradients to compute, in LinearDualGrads' order (grad_x, grad_weight_v, grad_weight_t, grad_bias_v,
// grad_bias_t): the others are returned undefined and cost nothing (a frozen expert's weights, a layer without
// biases, an input that needs no gradient).
using LinearDualOutputMask = std::array<bool, 5>;
// The ops' signatures (csrc/torch_bindings.cpp), for calls through the dispatcher: .typed<LinearDualOp>().
using LinearDualOp = at::Tensor(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                                const at::Tensor& weight_t, const std::optional<at::Tensor>& bias_v,
                                const std::optional<at::Tensor>& bias_t, bool allow_tf32);
using LinearDualBackwardOp = LinearDualGrads(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mask,
                                             const at::Tensor& weight_v, const at::Tensor& weight_t, bool allow_tf32,
                                             LinearDualOutputMask output_mask);

// CPU: the ATen reference (each token only through its own expert; math in fp32, fp64 for fp64 inputs).
at::Tensor linear_dual_cpu(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                           const at::Tensor& weight_t, const std::optional<at::Tensor>& bias_v,
                           const std::optional<at::Tensor>& bias_t, bool allow_tf32);
LinearDualGrads linear_dual_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mask,
                                         const at::Tensor& weight_v, const at::Tensor& weight_t, bool allow_tf32,
                                         LinearDualOutputMask output_mask);
// CUDA: routing + the routed GEMM kernels (csrc/ops/routed_gemm.h).
at::Tensor linear_dual_cuda(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& weight_v,
                            const at::Tensor& weight_t, const std::optional<at::Tensor>& bias_v,
                            const std::optional<at::Tensor>& bias_t, bool allow_tf32);
LinearDualGrads linear_dual_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mask,
                                          const at::Tensor& weight_v, const at::Tensor& weight_t, bool allow_tf32,
                                          LinearDualOutputMask output_mask);

}  // namespace fused
