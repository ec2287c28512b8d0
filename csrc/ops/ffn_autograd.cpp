// Autograd of ffn, in C++ so gradients flow from Python, TorchScript and libtorch alike. The backward calls the public
// fused::ffn_backward op through the dispatcher. What the forward keeps for it (csrc/ops/ffn_cuda.cpp "Backward"):
//  * recompute = False (default): its inputs and ffn_forward's gate_up (the gate and up pre-activations, 2 * I
//    elements per token), so that the backward runs no forward GEMM again;
//  * recompute = True: its inputs only; the backward computes gate and up again (two more GEMMs, no [M, 2I] kept).
// Where no gradient is recorded (no input requires one, or grad mode is off) the op runs as plain ffn and keeps
// nothing. ffn_forward and ffn_backward themselves are not differentiable (no double backward): their Autograd
// kernels raise if a gradient is asked through them.
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/ffn.h"
#include "ops/routed_gemm.h"

namespace {
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptT = std::optional<Tensor>;

OptT opt(const Tensor& t) { return t.defined() ? OptT(t) : std::nullopt; }

struct FfnFunction : public torch::autograd::Function<FfnFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2,
                        const OptT& mask, const OptT& u1, const OptT& u3, const OptT& u2, bool allow_tf32,
                        const OptT& routing, bool recompute, const OptT& residual) {
    auto value = [](const OptT& t) { return fused::present(t) ? *t : Tensor(); };
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out, gate_up;
    if (recompute) {
      static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn", "").typed<fused::FfnOp>();
      out = op.call(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing, recompute, residual);
    } else {
      static auto op =
          c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn_forward", "").typed<fused::FfnForwardOp>();
      std::tie(out, gate_up) = op.call(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing, residual);
    }
    ctx->save_for_backward({x, w1, w3, w2, value(mask), value(u1), value(u3), value(u2), value(routing), gate_up});
    ctx->saved_data["allow_tf32"] = allow_tf32;
    // The residual's index among the inputs autograd tracks (needs_input_grad counts the tensors given, not None)
    const int64_t given = 4 + fused::present(mask) + fused::present(u1) + fused::present(u3) + fused::present(u2) +
                          fused::present(routing);
    ctx->saved_data["residual_edge"] = fused::present(residual) ? given : int64_t{-1};
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn_backward", "").typed<fused::FfnBackwardOp>();
    const auto s = ctx->get_saved_variables();
    // Only what autograd asks for is computed: no grad_x for an input that needs none, no weight gradient of a
    // frozen weight (CogVLM trains the vision expert with the language model's weights frozen). A u that was not
    // given (single or stacked expert) needs none. Saved tensors keep the inputs' schema positions (kFfnGradInput),
    // which are also needs_input_grad's indices for the ones given: autograd counts the tensors given, and only an
    // absent u (whose slot is skipped) follows an absent one among the first eight.
    fused::FfnOutputMask want{};
    for (int slot = 0; slot < fused::kFfnGradSlots; ++slot) {
      const int input = fused::kFfnGradInput[slot];
      want[slot] = s[input].defined() && ctx->needs_input_grad(input);
    }
    const fused::FfnGradArray grad = fused::to_array(
        op.call(grads[0], s[0], s[1], s[2], s[3], opt(s[4]), opt(s[5]), opt(s[6]), opt(s[7]),
                ctx->saved_data["allow_tf32"].toBool(), want, opt(s[8]), opt(s[9])));
    // One gradient per argument of ffn, undefined for the non-differentiable ones (mask, allow_tf32, routing, ...).
    static const size_t num_args =
        c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn", "").schema().arguments().size();
    variable_list out(num_args);
    for (int slot = 0; slot < fused::kFfnGradSlots; ++slot) out[fused::kFfnGradInput[slot]] = grad[slot];
    // The residual is added to the output: its gradient is the output's.
    static const size_t residual_arg =
        *c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn", "").schema().argumentIndexWithName("residual");
    const int64_t residual_edge = ctx->saved_data["residual_edge"].toInt();
    if (residual_edge >= 0 && ctx->needs_input_grad(residual_edge)) out[residual_arg] = grads[0];
    return out;
  }
};

bool requires_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }
bool requires_grad(const OptT& t) { return fused::present(t) && t->requires_grad(); }

Tensor ffn(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2, const OptT& mask, const OptT& u1,
           const OptT& u3, const OptT& u2, bool allow_tf32, const OptT& routing, bool recompute,
           const OptT& residual) {
  const bool record = at::GradMode::is_enabled() &&
                      (requires_grad(x) || requires_grad(w1) || requires_grad(w3) || requires_grad(w2) ||
                       requires_grad(u1) || requires_grad(u3) || requires_grad(u2) || requires_grad(residual));
  if (!record) {  // inference: nothing to keep (ffn_forward's gate_up would be written for nothing)
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn", "").typed<fused::FfnOp>();
    return op.call(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing, recompute, residual);
  }
  return FfnFunction::apply(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing, recompute, residual);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Autograd, m) {
  m.impl("ffn", ffn);
  m.impl("ffn_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("ffn_backward", torch::autograd::autogradNotImplementedFallback());
}
