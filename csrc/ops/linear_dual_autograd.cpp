// Autograd of linear_dual, in C++ so gradients flow from Python, TorchScript and libtorch alike. The forward calls
// fused::linear_dual_forward and saves the routing of the mask it returns (or, given a routing, calls linear_dual with
// it and saves that); the backward passes it to the public fused::linear_dual_backward op, through the dispatcher (so
// it runs on whichever backend holds the tensors). A residual's gradient is the output's.
// linear_dual_forward and linear_dual_backward are not differentiable themselves (no double backward): their
// Autograd kernels raise if a gradient is asked through them.
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/linear_dual.h"
#include "ops/routed_gemm.h"

namespace {
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const c10::TypedOperatorHandle<fused::LinearDualOp>& linear_dual_op() {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fused::linear_dual", "").typed<fused::LinearDualOp>();
  return op;
}

struct LinearDualFunction : public torch::autograd::Function<LinearDualFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& mask, const Tensor& weight_v,
                        const std::optional<Tensor>& weight_t, const std::optional<Tensor>& bias_v,
                        const std::optional<Tensor>& bias_t, bool allow_tf32, const std::optional<Tensor>& given,
                        const std::optional<Tensor>& residual) {
    ctx->saved_data["allow_tf32"] = allow_tf32;
    // Each optional input's index among the inputs autograd tracks (needs_input_grad counts the tensors given, in
    // order: x, mask, weight_v, then whichever of weight_t, bias_v, bias_t, routing, residual are there), -1 if absent.
    int64_t next = 3;
    const auto edge = [&](const std::optional<Tensor>& t) { return fused::present(t) ? next++ : int64_t{-1}; };
    ctx->saved_data["weight_t_edge"] = edge(weight_t);
    ctx->saved_data["bias_v_edge"] = edge(bias_v);
    ctx->saved_data["bias_t_edge"] = edge(bias_t);
    edge(given);
    ctx->saved_data["residual_edge"] = edge(residual);
    at::AutoDispatchBelowADInplaceOrView guard;
    if (fused::present(given)) {
      ctx->save_for_backward({x, mask, weight_v, weight_t.value_or(Tensor()), *given});
      return linear_dual_op().call(x, mask, weight_v, weight_t, bias_v, bias_t, allow_tf32, given, residual);
    }
    // linear_dual_forward also returns the routing of mask it used: the backward takes it instead of routing again.
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fused::linear_dual_forward", "")
                         .typed<fused::LinearDualForwardOp>();
    auto [out, routing] = op.call(x, mask, weight_v, weight_t, bias_v, bias_t, allow_tf32, residual);
    ctx->save_for_backward({x, mask, weight_v, weight_t.value_or(Tensor()), routing});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fused::linear_dual_backward", "")
                         .typed<fused::LinearDualBackwardOp>();
    const auto s = ctx->get_saved_variables();
    // Only what autograd asks for is computed: no grad_x for an input that needs none, no weight gradient of a
    // frozen expert, no bias gradient of a missing or frozen bias (weight_t absent: both experts stacked in weight_v).
    const auto wanted = [&](const char* name) {
      const int64_t e = ctx->saved_data[name].toInt();
      return e >= 0 && ctx->needs_input_grad(e);
    };
    const fused::LinearDualOutputMask want = {ctx->needs_input_grad(0), ctx->needs_input_grad(2),
                                              wanted("weight_t_edge"), wanted("bias_v_edge"), wanted("bias_t_edge")};
    const std::optional<Tensor> weight_t = s[3].defined() ? std::optional<Tensor>(s[3]) : std::nullopt;
    auto [gx, gw_v, gw_t, gb_v, gb_t] =
        op.call(grads[0], s[0], s[1], s[2], weight_t, ctx->saved_data["allow_tf32"].toBool(), want, s[4]);
    // The residual is added to the output: its gradient is the output's.
    const Tensor g_res = wanted("residual_edge") ? grads[0] : Tensor();
    return {gx, Tensor() /* mask */, gw_v, gw_t, gb_v, gb_t, Tensor() /* allow_tf32 */, Tensor() /* routing */, g_res};
  }
};

Tensor linear_dual(const Tensor& x, const Tensor& mask, const Tensor& weight_v, const std::optional<Tensor>& weight_t,
                   const std::optional<Tensor>& bias_v, const std::optional<Tensor>& bias_t, bool allow_tf32,
                   const std::optional<Tensor>& routing, const std::optional<Tensor>& residual) {
  const auto grad = [](const std::optional<Tensor>& t) { return fused::present(t) && t->requires_grad(); };
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || weight_v.requires_grad() || grad(weight_t) ||
                                       grad(bias_v) || grad(bias_t) || grad(residual))) {
    // No graph to record: linear_dual itself, without the routing a backward would take.
    at::AutoDispatchBelowADInplaceOrView guard;
    return linear_dual_op().call(x, mask, weight_v, weight_t, bias_v, bias_t, allow_tf32, routing, residual);
  }
  return LinearDualFunction::apply(x, mask, weight_v, weight_t, bias_v, bias_t, allow_tf32, routing, residual);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Autograd, m) {
  m.impl("linear_dual", linear_dual);
  m.impl("linear_dual_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("linear_dual_backward", torch::autograd::autogradNotImplementedFallback());
}
