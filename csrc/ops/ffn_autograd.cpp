// Autograd of ffn, in C++ so gradients flow from Python, TorchScript and libtorch alike. The forward saves only its
// inputs (the backward recomputes gate and up: see ffn_cuda.cpp); the backward calls the public fused::ffn_backward
// op through the dispatcher. ffn_backward itself is not differentiable (no double backward): its Autograd kernel
// raises if a gradient is asked through it.
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/ffn.h"
#include "ops/routed_gemm.h"

namespace {
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptT = std::optional<Tensor>;

using FfnFn = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptT&, const OptT&, const OptT&,
                     const OptT&, bool);
using FfnBackwardFn = std::vector<Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                          const OptT&, const OptT&, const OptT&, const OptT&, bool);

OptT opt(const Tensor& t) { return t.defined() ? OptT(t) : std::nullopt; }

struct FfnFunction : public torch::autograd::Function<FfnFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2,
                        const OptT& mask, const OptT& u1, const OptT& u3, const OptT& u2, bool allow_tf32) {
    auto value = [](const OptT& t) { return fused::present(t) ? *t : Tensor(); };
    ctx->save_for_backward({x, w1, w3, w2, value(mask), value(u1), value(u3), value(u2)});
    ctx->saved_data["allow_tf32"] = allow_tf32;
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn", "").typed<FfnFn>();
    return op.call(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn_backward", "").typed<FfnBackwardFn>();
    const auto s = ctx->get_saved_variables();
    const bool dual = s[5].defined();
    std::vector<Tensor> g = op.call(grads[0], s[0], s[1], s[2], s[3], opt(s[4]), opt(s[5]), opt(s[6]), opt(s[7]),
                                    ctx->saved_data["allow_tf32"].toBool());
    // Inputs: x, w1, w3, w2, mask, u1, u3, u2, allow_tf32. Gradients of inputs that need none are dropped by autograd.
    return {g[0], g[1], g[2], g[3], Tensor(), dual ? g[4] : Tensor(), dual ? g[5] : Tensor(), dual ? g[6] : Tensor(),
            Tensor()};
  }
};

Tensor ffn(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2, const OptT& mask, const OptT& u1,
           const OptT& u3, const OptT& u2, bool allow_tf32) {
  return FfnFunction::apply(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Autograd, m) {
  m.impl("ffn", ffn);
  m.impl("ffn_backward", torch::autograd::autogradNotImplementedFallback());
}
