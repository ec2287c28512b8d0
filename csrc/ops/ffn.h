// ffn: the (dual-expert) SwiGLU MLP (docs/design.md "Routed GEMM ops"): shared checks and backends.
//   single expert (mask, u1, u3, u2 all None): out = w2(silu(x·w1ᵀ) ⊙ (x·w3ᵀ))
//   dual expert: token i uses (w1, w3, w2) if mask[i] (vision, expert 1) else (u1, u3, u2) (text, expert 0)
//   stacked dual expert (mask given, u1/u3/u2 None): w1, w3 [2, I, H], w2 [2, H, I] hold both experts, [0] text and
//     [1] vision (DualExpertSwiGLU's parameters, torch._grouped_mm's layout); their gradients come back stacked too
//     (grad_w1/w3/w2 [2, ...], grad_u* None), so that a stacked parameter gets its gradient with no per-expert
//     scatter into zeros and sum (what autograd does for views w[0], w[1]: ~1.2 ms per training step of CogVLM2's MLP)
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>
#include <utility>

namespace fused {

template <typename Int>
struct FfnGeometryOf {
  Int M;      // rows: the product of x's leading dimensions
  Int H;      // hidden size
  Int I;      // intermediate size
  bool dual;  // two experts: u1/u3/u2 and mask given, or stacked weights and mask
  bool stacked = false;  // w1, w3 [2, I, H] and w2 [2, H, I]: [0] text, [1] vision (u1/u3/u2 None)
};
using FfnGeometry = FfnGeometryOf<int64_t>;
using FfnSymGeometry = FfnGeometryOf<c10::SymInt>;

// Shapes, dtypes, devices and the single/dual-expert argument rules (no data read). routing: the dual expert's only,
// fused.route(mask)'s (check_routing in csrc/ops/routed_gemm.h). The _symint checks read symbolic sizes (the Meta
// kernels) and guard only the relations the op needs (csrc/ops/routed_gemm.h, sym_equal); the others are the same
// checks on concrete tensors (the CPU and CUDA kernels).
FfnSymGeometry check_ffn_inputs_symint(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3,
                                       const at::Tensor& w2, const std::optional<at::Tensor>& mask,
                                       const std::optional<at::Tensor>& u1, const std::optional<at::Tensor>& u3,
                                       const std::optional<at::Tensor>& u2, const std::optional<at::Tensor>& routing);
FfnSymGeometry check_ffn_backward_inputs_symint(const at::Tensor& grad_out, const at::Tensor& x,
                                                const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2,
                                                const std::optional<at::Tensor>& mask,
                                                const std::optional<at::Tensor>& u1,
                                                const std::optional<at::Tensor>& u3,
                                                const std::optional<at::Tensor>& u2,
                                                const std::optional<at::Tensor>& routing);
FfnGeometry check_ffn_inputs(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2,
                             const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& u1,
                             const std::optional<at::Tensor>& u3, const std::optional<at::Tensor>& u2,
                             const std::optional<at::Tensor>& routing);
FfnGeometry check_ffn_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w1,
                                      const at::Tensor& w3, const at::Tensor& w2,
                                      const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& u1,
                                      const std::optional<at::Tensor>& u3, const std::optional<at::Tensor>& u2,
                                      const std::optional<at::Tensor>& routing);

// The argument list shared by ffn and ffn_backward after their leading tensors (their last argument, routing, follows
// ffn_backward's output_mask).
#define FUSED_FFN_ARGS                                                                                             \
  const at::Tensor &w1, const at::Tensor &w3, const at::Tensor &w2, const std::optional<at::Tensor>&mask,         \
      const std::optional<at::Tensor>&u1, const std::optional<at::Tensor>&u3, const std::optional<at::Tensor>&u2, \
      bool allow_tf32

// gate_up, the activations ffn_forward saves for ffn_backward: [..., 2I] with x's leading shape and dtype, in token
// order, gate_up[t] = [x_t · W1ᵀ, x_t · W3ᵀ] with each token's own expert's weights (the gate and up
// pre-activations). Checks its shape, dtype and device (the _symint one for the Meta kernels).
void check_gate_up_symint(const at::Tensor& gate_up, const at::Tensor& x, const c10::SymInt& I, const char* op);
void check_gate_up(const at::Tensor& gate_up, const at::Tensor& x, int64_t I, const char* op);
// ffn's residual: x's shape, dtype and device (the _symint one for the Meta kernels); nothing when absent.
void check_residual_symint(const std::optional<at::Tensor>& residual, const at::Tensor& x);
void check_residual(const std::optional<at::Tensor>& residual, const at::Tensor& x);

// (grad_x, grad_w1, grad_w3, grad_w2, grad_u1, grad_u3, grad_u2); the u gradients are undefined for the single and the
// stacked expert (whose grad_w* hold both experts).
using FfnGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
constexpr int kFfnGradSlots = std::tuple_size_v<FfnGrads>;
// FfnGrads as an array indexed by FfnGradSlot, and back: the backends fill slots by name, not by tuple position.
using FfnGradArray = std::array<at::Tensor, kFfnGradSlots>;
inline FfnGrads to_tuple(FfnGradArray a) {
  return std::apply([](auto&... t) { return FfnGrads(std::move(t)...); }, a);
}
inline FfnGradArray to_array(FfnGrads g) {
  return std::apply([](auto&... t) { return FfnGradArray{std::move(t)...}; }, g);
}
// Which of FfnGrads to compute, in its order: the others are returned undefined, and their work is skipped (a frozen
// expert's weights, an input that needs no gradient). The last three are ignored for the single and stacked expert.
using FfnOutputMask = std::array<bool, kFfnGradSlots>;
// The slots of FfnGrads and FfnOutputMask (the op's schema order): every backend and the autograd name them here.
enum FfnGradSlot : int { kGradX = 0, kGradW1 = 1, kGradW3 = 2, kGradW2 = 3, kGradU1 = 4, kGradU3 = 5, kGradU2 = 6 };
// The position in ffn's schema, ffn(x, w1, w3, w2, mask, u1, u3, u2, ...), of each slot's input (the autograd's
// map from gradients to inputs).
constexpr int kFfnGradInput[kFfnGradSlots] = {0, 1, 2, 3, 5, 6, 7};
// Projections in slot order within an expert: gate (w1 / u1), up (w3 / u3), down (w2 / u2).
enum FfnProj : int { kGate = 0, kUp = 1, kDown = 2 };
// The slot of projection `proj` of expert `expert` (0 = text, 1 = vision; the single expert is 0): the vision
// expert's weights are w*, the text expert's u*, except where one tensor holds both (single: w*; stacked: w*[e]).
template <typename G>
int ffn_grad_slot(const G& geo, int expert, int proj) {
  return (geo.dual && !geo.stacked && expert == 0 ? kGradU1 : kGradW1) + proj;
}
// The ops' signatures (csrc/torch_bindings.cpp), for calls through the dispatcher: .typed<FfnOp>(). ffn's
// `recompute` is read only by its autograd (csrc/ops/ffn_autograd.cpp): the backends compute the same output.
using FfnOp = at::Tensor(const at::Tensor& x, FUSED_FFN_ARGS, const std::optional<at::Tensor>& routing,
                         bool recompute, const std::optional<at::Tensor>& residual);
using FfnForwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& x, FUSED_FFN_ARGS,
                                                        const std::optional<at::Tensor>& routing,
                                                        const std::optional<at::Tensor>& residual);
using FfnBackwardOp = FfnGrads(const at::Tensor& grad_out, const at::Tensor& x, FUSED_FFN_ARGS,
                               FfnOutputMask output_mask, const std::optional<at::Tensor>& routing,
                               const std::optional<at::Tensor>& gate_up);

// CPU: the ATen reference (each token only through its own expert; math in fp32, fp64 for fp64 inputs).
at::Tensor ffn_cpu(const at::Tensor& x, FUSED_FFN_ARGS, const std::optional<at::Tensor>& routing, bool recompute,
                   const std::optional<at::Tensor>& residual);
std::tuple<at::Tensor, at::Tensor> ffn_forward_cpu(const at::Tensor& x, FUSED_FFN_ARGS,
                                                   const std::optional<at::Tensor>& routing,
                                                   const std::optional<at::Tensor>& residual);
FfnGrads ffn_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, FUSED_FFN_ARGS, FfnOutputMask output_mask,
                          const std::optional<at::Tensor>& routing, const std::optional<at::Tensor>& gate_up);
// CUDA: routing + the routed GEMM kernels (csrc/ops/routed_gemm.h).
at::Tensor ffn_cuda(const at::Tensor& x, FUSED_FFN_ARGS, const std::optional<at::Tensor>& routing, bool recompute,
                    const std::optional<at::Tensor>& residual);
std::tuple<at::Tensor, at::Tensor> ffn_forward_cuda(const at::Tensor& x, FUSED_FFN_ARGS,
                                                    const std::optional<at::Tensor>& routing,
                                                    const std::optional<at::Tensor>& residual);
FfnGrads ffn_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, FUSED_FFN_ARGS, FfnOutputMask output_mask,
                           const std::optional<at::Tensor>& routing, const std::optional<at::Tensor>& gate_up);

}  // namespace fused
