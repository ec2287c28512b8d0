// Autograd of ffn, in C++ so gradients flow from Python, TorchScript and libtorch alike. The forward saves only its
// inputs and the routing given (the backward recomputes gate and up: see ffn_cuda.cpp); the backward calls the
// public fused::ffn_backward op through the dispatcher. ffn_backward itself is not differentiable (no double
// backward): its Autograd kernel raises if a gradient is asked through it.
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
                        const OptT& routing) {
    auto value = [](const OptT& t) { return fused::present(t) ? *t : Tensor(); };
    ctx->save_for_backward({x, w1, w3, w2, value(mask), value(u1), value(u3), value(u2), value(routing)});
    ctx->saved_data["allow_tf32"] = allow_tf32;
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn", "").typed<fused::FfnOp>();
    return op.call(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn_backward", "").typed<fused::FfnBackwardOp>();
    const auto s = ctx->get_saved_variables();
    const bool dual = s[5].defined();
    // Only what autograd asks for is computed: no grad_x for an input that needs none, no weight gradient of a
    // frozen weight (CogVLM trains the vision expert with the language model's weights frozen). needs_input_grad
    // counts the tensor inputs given: x, w1, w3, w2, then mask, u1, u3, u2 for the dual expert.
    const auto need = [&](size_t i) { return ctx->needs_input_grad(i); };
    const fused::FfnOutputMask want = {need(0), need(1), need(2), need(3), dual && need(5), dual && need(6),
                                       dual && need(7)};
    auto [gx, gw1, gw3, gw2, gu1, gu3, gu2] = op.call(grads[0], s[0], s[1], s[2], s[3], opt(s[4]), opt(s[5]),
                                                      opt(s[6]), opt(s[7]), ctx->saved_data["allow_tf32"].toBool(),
                                                      want, opt(s[8]));
    // Inputs: x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing.
    return {gx, gw1, gw3, gw2, Tensor() /* mask */, gu1, gu3, gu2, Tensor() /* allow_tf32 */, Tensor() /* routing */};
  }
};

Tensor ffn(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2, const OptT& mask, const OptT& u1,
           const OptT& u3, const OptT& u2, bool allow_tf32, const OptT& routing) {
  return FfnFunction::apply(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Autograd, m) {
  m.impl("ffn", ffn);
  m.impl("ffn_backward", torch::autograd::autogradNotImplementedFallback());
}
